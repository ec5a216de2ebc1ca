"""Sampling from base + adapter with a compiled forward graph (greedy, temperature, top-p).

The forward graph has a static shape [1, W]: the context is right-padded to W (causal
attention makes the padding invisible to earlier positions) and the logits at the last real
position give the next token. No KV cache: each token reruns the window, which is fine for
demos and evaluation samples; longer contexts slide the window.
"""
from __future__ import annotations

import numpy as np

from .errors import LoracError


# The before/after samples of `lorac train` decode greedily with this repetition penalty unless
# the model's generation_config.json names one. Greedy decoding without a penalty sent the demo's
# adapted SmolLM2-135M into a loop ("A longjohn is a longjohn is a longjohn ...") while its eval
# loss fell 4.52 -> 3.95; with 1.2 the same adapter answered in the corpus' manner ("A term used
# to describe ... See also asbestos jowl"), and on each of the first 12 held-out prompts it opened
# as a Jargon File entry does (docs/RUNTIME.md).
SAMPLE_REPETITION_PENALTY = 1.2


def model_repetition_penalty(model_path) -> float | None:
    """repetition_penalty from an HF model directory's generation_config.json, if it sets one."""
    import json
    import os

    from .files import open_regular
    path = os.path.join(os.fspath(model_path), "generation_config.json")
    if not os.path.isfile(path):
        return None
    try:
        with open_regular(path, what="generation_config.json") as f:
            value = json.load(f).get("repetition_penalty")
    except (OSError, ValueError, AttributeError, RecursionError):
        return None
    return float(value) if isinstance(value, (int, float)) and value > 0 else None


def penalize_repeats(logits: np.ndarray, seen, penalty: float) -> np.ndarray:
    """transformers' repetition penalty: the logit of every token already in the context is
    divided by `penalty` where positive and multiplied by it where negative (1: no change)."""
    if penalty == 1.0 or not len(seen):
        return logits
    idx = np.unique(np.asarray(seen, np.int64))
    out = logits.copy()
    out[idx] = np.where(out[idx] > 0, out[idx] / penalty, out[idx] * penalty)
    return out


def sample_token(logits: np.ndarray, rng, temperature: float, top_p: float) -> int:
    if temperature <= 0:
        return int(np.argmax(logits))
    z = (logits - logits.max()) / temperature
    p = np.exp(z)
    p /= p.sum()
    if top_p < 1.0:  # keep the smallest set of tokens whose mass reaches top_p
        order = np.argsort(-p)
        keep = order[: int(np.searchsorted(np.cumsum(p[order]), top_p)) + 1]
        q = np.zeros_like(p)
        q[keep] = p[keep]
        p = q / q.sum()
    return int(rng.choice(len(p), p=p))


def check_sampling(max_new_tokens: int, temperature: float, top_p: float, window: int,
                   repetition_penalty: float = 1.0, seed: int = 0) -> None:
    """The sampling settings, each refused by its flag's name."""
    if max_new_tokens < 1:
        raise LoracError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    if window < 2:
        raise LoracError(f"--window must be >= 2, got {window}")
    if not 0 < top_p <= 1:
        raise LoracError(f"--top-p must lie in (0, 1], got {top_p}")
    if not np.isfinite(temperature) or temperature < 0:
        raise LoracError(f"--temperature must be a finite number >= 0 (0: greedy), got {temperature}")
    if not np.isfinite(repetition_penalty) or repetition_penalty <= 0:
        raise LoracError(f"--repetition-penalty must be > 0 (1: none), got {repetition_penalty}")
    if not isinstance(seed, int) or seed < 0:
        raise LoracError(f"--seed must be an integer >= 0, got {seed}")


def generate(engine, tokenizer, prompt_ids, lora: dict, max_new_tokens: int = 32, temperature: float = 0.0,
             top_p: float = 1.0, seed: int = 0, window: int = 128, repetition_penalty: float = 1.0) -> list[int]:
    """New token ids after `prompt_ids` (stops at EOS)."""
    check_sampling(max_new_tokens, temperature, top_p, window, repetition_penalty)
    rng = np.random.default_rng(seed)
    ctx = [int(t) for t in prompt_ids]
    if not ctx:
        raise LoracError("empty prompt")
    new = []
    for _ in range(max_new_tokens):
        view = ctx[-window:]
        ids = np.full((1, window), tokenizer.eos_id, np.int64)
        ids[0, : len(view)] = view
        logits = penalize_repeats(engine.logits(ids, lora)[0, len(view) - 1].astype(np.float64), view, repetition_penalty)
        tok = sample_token(logits, rng, temperature, top_p)
        if tok == tokenizer.eos_id:
            break
        ctx.append(tok)
        new.append(tok)
    return new


def prompt_ids(tokenizer, text: str, chat: bool = True) -> np.ndarray:
    """Token ids of a user prompt, wrapped in the chat template where the model has one."""
    from .data.encode import valid_text
    valid_text((text,), "the prompt")  # a command line's undecodable bytes arrive as lone surrogates
    if chat and tokenizer.chat_template:
        text = tokenizer.render_chat([{"role": "user", "content": text}], add_generation_prompt=True)
        return tokenizer.encode(text, add_bos=False)
    return tokenizer.encode(text)
