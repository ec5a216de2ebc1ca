"""A small tokenizer wrapper: the HF `tokenizers` library for the text <-> ids work, the
special ids and the chat template next to it. Built from an HF directory
(tokenizer.json + tokenizer_config.json / chat_template.jinja) or a GGUF file.

Special tokens are added by this wrapper, never by the backend's post-processor, so one
rule (`add_bos`) holds whichever source the tokenizer came from.
"""

import os

import numpy as np

from ..errors import LoracError
from ..files import check_regular, open_regular, read_json


class Tokenizer:
    def __init__(self, backend, eos_id, bos_id=None, add_bos=False, chat_template=None, source=""):
        self.backend = backend          # tokenizers.Tokenizer
        self.eos_id = int(eos_id)
        self.bos_id = None if bos_id is None else int(bos_id)
        self.add_bos = bool(add_bos and bos_id is not None)
        self.chat_template = chat_template
        self.source = str(source)
        self._template = None           # compiled jinja2 template, made on first use

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token(self) -> str:
        return self.backend.id_to_token(self.eos_id)

    @property
    def bos_token(self):
        return None if self.bos_id is None else self.backend.id_to_token(self.bos_id)

    def encode(self, text: str, add_bos=None) -> np.ndarray:
        """text -> int64 ids (BOS first when the model expects it; never EOS)."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        use_bos = self.add_bos if add_bos is None else bool(add_bos)
        if use_bos and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return np.asarray(ids, dtype=np.int64)

    def encode_batch(self, texts):
        """[text] -> [tokenizers.Encoding] (ids and char offsets), no special tokens added."""
        return self.backend.encode_batch(list(texts), add_special_tokens=False)

    def decode(self, ids, skip_special=True) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def render_chat(self, messages, add_generation_prompt=False) -> str:
        """messages [{role, content}] -> the prompt text the model was tuned on."""
        if not self.chat_template:
            raise LoracError(f"tokenizer from {self.source or 'this model'} has no chat template; "
                             "chat data needs one (use prompt/completion or text data instead)")
        from . import chat_template  # sandboxed and bounded in size and time
        if self._template is None:
            self._template = chat_template.compile_template(self.chat_template, self.source)
        size = sum(len(m["content"]) for m in messages if isinstance(m, dict) and isinstance(m.get("content"), str))
        return chat_template.render(self._template, size, messages=messages, add_generation_prompt=add_generation_prompt,
                                    bos_token=self.bos_token or "", eos_token=self.eos_token)

    def chat_spans(self, messages) -> tuple[str, list]:
        """(rendered conversation, [(start, end)] char spans of the assistant turns).

        A span is what rendering turn i adds after the prompt that asks for it
        (render(messages[:i], add_generation_prompt=True)): the answer and its end marker.
        That needs the template to render a conversation prefix as a prefix of the text,
        which holds for ChatML-style templates; where it does not, refuse rather than mask wrong.
        """
        full = self.render_chat(messages)
        spans = []
        for i, m in enumerate(messages):
            if m.get("role") != "assistant":
                continue
            prompt = self.render_chat(messages[:i], add_generation_prompt=True)
            upto = self.render_chat(messages[:i + 1])
            if not (upto.startswith(prompt) and full.startswith(upto)):
                raise LoracError("the chat template does not render conversations incrementally, so "
                                 "assistant turns cannot be located for loss masking")
            spans.append((len(prompt), len(upto)))
        return full, spans


def _token_text(value):
    """tokenizer_config.json writes special tokens as a string or {"content": ...}."""
    return value.get("content") if isinstance(value, dict) else value


def load_hf_tokenizer(model_dir) -> Tokenizer:
    """tokenizer.json + tokenizer_config.json (+ chat_template.jinja, config.json) in model_dir."""
    from tokenizers import Tokenizer as Backend

    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.exists(path):
        raise LoracError(f"{model_dir}: no tokenizer.json")
    check_regular(path, "tokenizer.json")
    try:
        backend = Backend.from_file(path)
    except Exception as e:  # the Rust side raises a bare Exception
        raise LoracError(f"{path}: not a readable tokenizer ({e})") from None
    cfg = _read_json(os.path.join(model_dir, "tokenizer_config.json"))
    model_cfg = _read_json(os.path.join(model_dir, "config.json"))

    template = cfg.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}]
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    jinja_file = os.path.join(model_dir, "chat_template.jinja")
    if template is None and os.path.exists(jinja_file):
        with open_regular(jinja_file, what="chat template") as f:
            template = f.read()

    def token_id(kind):
        text = _token_text(cfg.get(f"{kind}_token"))
        tid = backend.token_to_id(text) if text else None
        if tid is None:
            tid = model_cfg.get(f"{kind}_token_id")
            tid = tid[0] if isinstance(tid, list) else tid
        return tid

    eos_id, bos_id = token_id("eos"), token_id("bos")
    if eos_id is None:
        raise LoracError(f"{model_dir}: no EOS token (tokenizer_config.json eos_token or config.json eos_token_id)")
    add_bos = cfg.get("add_bos_token")
    if add_bos is None and bos_id is not None:
        # no flag: follow what the backend's own post-processor would do
        ids = backend.encode("a", add_special_tokens=True).ids
        add_bos = bool(ids) and ids[0] == bos_id
    return Tokenizer(backend, eos_id, bos_id, bool(add_bos), template, model_dir)


def _read_json(path):
    if not os.path.exists(path):
        return {}
    return read_json(path)


def load_gguf_tokenizer(path) -> Tokenizer:
    from .gguf import build_tokenizer, tokenizer_info

    info = tokenizer_info(path)
    if info["eos_id"] is None:
        raise LoracError(f"{path}: GGUF tokenizer has no EOS id (tokenizer.ggml.eos_token_id)")
    return Tokenizer(build_tokenizer(info), info["eos_id"], info["bos_id"], info["add_bos"],
                     info["chat_template"], path)


def load_tokenizer(path) -> Tokenizer:
    """The tokenizer of a model: an HF directory or a .gguf file."""
    path = os.fspath(path)
    if os.path.isfile(path) and path.endswith(".gguf"):
        return load_gguf_tokenizer(path)
    if not os.path.isdir(path):
        raise LoracError(f"model not found: {path}")
    return load_hf_tokenizer(path)
