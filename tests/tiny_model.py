"""A tiny random HF model directory (config, safetensors, char-level tokenizer, ChatML template)
and a small learnable corpus, for end-to-end tests that must not touch a hub."""
from __future__ import annotations

import json
import string
from pathlib import Path

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def char_tokenizer(chars: str = string.ascii_letters + string.digits + string.punctuation + " \n"):
    """A WordLevel `tokenizers.Tokenizer` over single characters, with ChatML's specials
    (ids 0-3: <unk>, <|endoftext|>, <|im_start|>, <|im_end|>)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    vocab = {c: i for i, c in enumerate(["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"] + list(chars))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    return tok


def char_tokenizer_json(path: Path) -> int:
    """char_tokenizer() saved as tokenizer.json; returns the vocab size."""
    tok = char_tokenizer()
    tok.save(str(path))
    return tok.get_vocab_size()


def make_model_dir(root: Path, arch: str = "qwen3", layers: int = 2, seed: int = 0, **over) -> Path:
    import pytest
    torch = pytest.importorskip("torch")  # transformers writes the model: without torch the test skips
    transformers = pytest.importorskip("transformers")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    vocab = char_tokenizer_json(root / "tokenizer.json")
    cfg = dict(vocab_size=vocab, hidden_size=48, intermediate_size=96, num_hidden_layers=layers,
               num_attention_heads=4, num_key_value_heads=2, head_dim=12, tie_word_embeddings=True,
               eos_token_id=1, bos_token_id=None, max_position_embeddings=512)
    cfg.update(over)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(arch, **cfg)).float()
    model.save_pretrained(root, safe_serialization=True)
    (root / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|endoftext|>", "chat_template": CHATML, "add_bos_token": False}))
    return root


def make_mamba_dir(root: Path, layers: int = 2, seed: int = 0, **over) -> Path:
    """A tiny random HF MambaForCausalLM directory with the same char tokenizer. HF's init
    gives dt in [1e-3, 0.1]; dt_proj's bias is raised to softplus^-1(U(0.2, 1.5)) so the scan
    (and LoRA on x_proj / dt_proj) matters."""
    import pytest
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    vocab = char_tokenizer_json(root / "tokenizer.json")
    cfg = dict(vocab_size=vocab, hidden_size=32, state_size=8, expand=2, conv_kernel=4, num_hidden_layers=layers,
               tie_word_embeddings=True, eos_token_id=1, bos_token_id=None, pad_token_id=0)
    cfg.update(over)
    torch.manual_seed(seed)
    model = transformers.MambaForCausalLM(transformers.MambaConfig(**cfg)).float()
    with torch.no_grad():
        for layer in model.backbone.layers:
            dt = 0.2 + 1.3 * torch.rand_like(layer.mixer.dt_proj.bias)
            layer.mixer.dt_proj.bias.copy_(dt + torch.log(-torch.expm1(-dt)))
    model.save_pretrained(root, safe_serialization=True)
    (root / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|endoftext|>", "chat_template": CHATML, "add_bos_token": False}))
    return root


def make_numpy_qwen3(root: Path, layers: int = 1, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
                     head_dim: int = 16, intermediate: int = 128, seed: int = 0) -> Path:
    """A tiny random Qwen3 directory written with numpy alone (no torch, no transformers), for
    machines that have lorac's runtime but not the oracles (the GPU machine)."""
    import numpy as np
    from safetensors.numpy import save_file
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    vocab = char_tokenizer_json(root / "tokenizer.json")
    (root / "config.json").write_text(json.dumps(dict(
        model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=vocab, hidden_size=hidden,
        intermediate_size=intermediate, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=head_dim, hidden_act="silu", rms_norm_eps=1e-6, rope_theta=10000.0,
        max_position_embeddings=512, tie_word_embeddings=True, eos_token_id=1, bos_token_id=None,
        torch_dtype="float32")))
    (root / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|endoftext|>", "chat_template": CHATML, "add_bos_token": False}))
    rng = np.random.default_rng(seed)
    w = lambda *shape: (rng.standard_normal(shape) * 0.05).astype(np.float32)  # noqa: E731
    ones = lambda n: np.ones(n, np.float32)  # noqa: E731
    t = {"model.embed_tokens.weight": w(vocab, hidden), "model.norm.weight": ones(hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        t.update({p + "input_layernorm.weight": ones(hidden), p + "post_attention_layernorm.weight": ones(hidden),
                  p + "self_attn.q_norm.weight": ones(head_dim), p + "self_attn.k_norm.weight": ones(head_dim),
                  p + "self_attn.q_proj.weight": w(heads * head_dim, hidden),
                  p + "self_attn.k_proj.weight": w(kv_heads * head_dim, hidden),
                  p + "self_attn.v_proj.weight": w(kv_heads * head_dim, hidden),
                  p + "self_attn.o_proj.weight": w(hidden, heads * head_dim),
                  p + "mlp.gate_proj.weight": w(intermediate, hidden), p + "mlp.up_proj.weight": w(intermediate, hidden),
                  p + "mlp.down_proj.weight": w(hidden, intermediate)})
    save_file(t, str(root / "model.safetensors"), metadata={"format": "pt"})
    return root


def make_corpus(path: Path, n: int = 200) -> Path:
    """Repetitive text a tiny model learns in a few dozen steps."""
    lines = [f"the {c} cat sat on the {m} mat.\n\n" for c, m in zip(["red", "big", "old", "sly"] * n, ["blue", "flat", "new"] * n)]
    Path(path).write_text("".join(lines[:n]))
    return Path(path)


def make_workdir(root: Path) -> Path:
    """root/model (make_model_dir) and root/corpus.txt (make_corpus, 240 documents): what the
    end-to-end tests train on."""
    make_model_dir(Path(root) / "model")
    make_corpus(Path(root) / "corpus.txt", 240)
    return Path(root)


def compiled_logits(model_dir: Path, cache: Path, lora: dict, ids):
    """Logits of lorac's compiled CPU forward graph (every target of the family, rank 16,
    alpha 32) with the given LoRA tensors; tensors missing from `lora` are zero."""
    import numpy as np
    from lorac.graphs import ModelSpec, TrainSpec
    from lorac.runtime.engine.tvm import Engine
    from lorac.runtime.model.weights import load_model
    cfg, weights = load_model(model_dir)
    spec = ModelSpec.from_hf_config(cfg)
    train = TrainSpec(batch=1, seq=ids.shape[1], lora_targets=tuple(spec.targets), rank=16, alpha=32.0)
    eng = Engine(spec, train, weights, "cpu", cache_dir=cache, log=lambda m: None)
    return eng.logits(ids, {n: lora.get(n, np.zeros(s, np.float32)) for n, s in eng.shapes.items()})
