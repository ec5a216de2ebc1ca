"""llama.cpp GGUF files -> an HF-style config dict, float32 weights under HF names, and a
`tokenizers.Tokenizer` built from the file's vocabulary.

GGUF keeps what HF splits over config.json, model.safetensors and tokenizer.json in one
file: metadata keys (`llama.embedding_length`, `tokenizer.ggml.tokens`, ...) and tensors
named `blk.N.attn_q.weight` etc. Dequantization lives in gguf_quant.py.

Q/K permutation. For llama-family models llama.cpp's convert_hf_to_gguf reorders the
rows of q_proj and k_proj inside each head: HF's RoPE rotates the two halves of a head
(i, i + d/2), llama.cpp's rotates neighbours (2i, 2i+1), so the converter maps HF row
(half h, i) to GGUF row (i, h), per head (for k_proj, per KV head). `unpermute_qk`
is the inverse. Qwen2/Qwen3 files are written without it (llama.cpp runs those with the
NeoX, i.e. HF, rotation), so they are not touched.
"""

import numpy as np

from .errors import LoracError
from .gguf_quant import dequantize
from .weights import as_dtype, check_weights

# general.architecture -> (HF model_type, whether Q/K rows carry llama.cpp's permutation)
ARCHITECTURES = {
    "llama": ("llama", True),
    "mistral": ("mistral", True),
    "qwen2": ("qwen2", False),
    "qwen3": ("qwen3", False),
}

# per-layer GGUF tensor stem -> HF module path inside model.layers.N
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# Tensors llama.cpp writes that carry no weights HF has: rope_freqs holds llama-3 style
# RoPE scaling factors, which lorac does not implement, so a file with it is refused.
UNSUPPORTED_TENSORS = {"rope_freqs.weight": "llama-3 RoPE frequency scaling (rope_freqs)"}


def open_gguf(path):
    """A `gguf.GGUFReader` on `path` (memory-mapped), or a one-line LoracError."""
    import gguf  # a hard dependency, imported here so HF-only users never pay for it

    try:
        return gguf.GGUFReader(str(path), "r")
    except FileNotFoundError:
        raise LoracError(f"GGUF file not found: {path}") from None
    except (ValueError, OSError, IndexError, KeyError) as e:
        raise LoracError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


def metadata(reader) -> dict:
    """All metadata keys -> python values, except the large tokenizer arrays."""
    skip = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
            "tokenizer.ggml.scores")
    return {k: f.contents() for k, f in reader.fields.items() if k not in skip}


def architecture(meta: dict, path="GGUF file") -> tuple[str, str, bool]:
    """(gguf arch, HF model_type, permuted Q/K) or a LoracError naming the architecture."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise LoracError(f"{path}: GGUF architecture {arch!r} is not supported "
                         f"(supported: {', '.join(ARCHITECTURES)})")
    model_type, permuted = ARCHITECTURES[arch]
    # llama.cpp writes Mistral 7B files as "llama"; the name is the only trace left.
    if arch == "llama" and "mistral" in str(meta.get("general.name", "")).lower():
        model_type = "mistral"
    return arch, model_type, permuted


def hf_config(meta: dict, tensor_names, path="GGUF file", vocab_len=None) -> dict:
    """GGUF metadata -> the config.json dict HF would have for the same model."""
    arch, model_type, _ = architecture(meta, path)

    def need(key, default=None):
        """A positive integer metadata value (GGUF stores counts as unsigned ints)."""
        v = meta.get(f"{arch}.{key}", default)
        if v is None:
            raise LoracError(f"{path}: GGUF metadata key {arch}.{key} is missing")
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise LoracError(f"{path}: GGUF metadata {arch}.{key}={v!r} must be a positive integer")
        return v

    def num(key, default):
        v = meta.get(f"{arch}.{key}", default)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not np.isfinite(v):
            raise LoracError(f"{path}: GGUF metadata {arch}.{key}={v!r} must be a finite number")
        return float(v)

    hidden = need("embedding_length")
    heads = need("attention.head_count")
    kv_heads = need("attention.head_count_kv", heads)
    # key_length is written when head_dim != hidden/heads (Qwen3); else it is implied.
    head_dim = need("attention.key_length", max(hidden // heads, 1))
    n_vocab = meta.get(f"{arch}.vocab_size")
    if n_vocab is None:  # older files: the vocabulary's length is the vocab size
        n_vocab = vocab_len
    if n_vocab is None:
        raise LoracError(f"{path}: GGUF file states no vocabulary size and has no vocabulary")
    if not isinstance(n_vocab, int) or isinstance(n_vocab, bool) or n_vocab < 1:
        raise LoracError(f"{path}: GGUF vocabulary size {n_vocab!r} must be a positive integer")
    config = {
        "model_type": model_type,
        "architectures": [{"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                           "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[model_type]],
        "hidden_size": hidden,
        "num_hidden_layers": need("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": need("feed_forward_length"),
        "rms_norm_eps": num("attention.layer_norm_rms_epsilon", 1e-6),
        # 10000 is llama.cpp's own default when the key is absent
        "rope_theta": num("rope.freq_base", 10000.0),
        "max_position_embeddings": need("context_length", 2048),
        "vocab_size": n_vocab,
        "tie_word_embeddings": "output.weight" not in set(tensor_names),
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    for key, field in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                       ("pad_token_id", "padding_token_id")):
        if f"tokenizer.ggml.{field}" in meta:
            config[key] = int(meta[f"tokenizer.ggml.{field}"])
    return config


def hf_name(name: str) -> str:
    """GGUF tensor name -> HF name (`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`)."""
    if name in UNSUPPORTED_TENSORS:
        raise LoracError(f"GGUF tensor {name}: {UNSUPPORTED_TENSORS[name]} is not supported")
    stem, _, kind = name.rpartition(".")
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in LAYER_NAMES:
        return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}.{kind}"
    if stem in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[stem]}.{kind}"
    raise LoracError(f"GGUF tensor {name} has no HF counterpart lorac knows")


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's RoPE row order on q_proj/k_proj rows (weights [out, in] or bias [out]).

    Per head of d rows the file holds row 2i + h for HF row h*d/2 + i (h in {0, 1}); viewing
    the rows as [head, i, h] and swapping to [head, h, i] restores HF's order.
    """
    d = w.shape[0] // n_head
    return w.reshape(n_head, d // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_config(reader, path="GGUF file", meta=None) -> dict:
    """The HF config dict of an open GGUF file (hf_config over its metadata and tensor names)."""
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    return hf_config(meta or metadata(reader), [t.name for t in reader.tensors], path,
                     vocab_len=len(tokens.data) if tokens else None)


def float_dtype(path) -> str:
    """The float dtype a GGUF file's matrices are stored in ("float32", "float16", "bfloat16"),
    "bfloat16" for a quantized file: what a merged export writes by default."""
    names = {0: "float32", 1: "float16", 30: "bfloat16"}
    kinds = {int(t.tensor_type) for t in open_gguf(path).tensors if len(t.shape) == 2}
    return names.get(kinds.pop() if len(kinds) == 1 else None, "bfloat16")


def load_gguf(path, dtype=np.float32) -> tuple[dict, dict]:
    """(HF config dict, {HF name: array}) for a GGUF file; every tensor dequantized to dtype."""
    reader = open_gguf(path)
    meta = metadata(reader)
    config = gguf_config(reader, path, meta)
    _, _, permuted = architecture(meta, path)
    weights = {}
    for t in reader.tensors:
        key = hf_name(t.name)
        # GGUF lists dimensions fastest-first ([in, out]); numpy wants [out, in].
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))
        w = dequantize(t.data, int(t.tensor_type), shape, t.name)
        if permuted and key.endswith(("q_proj.weight", "q_proj.bias")):
            w = unpermute_qk(w, config["num_attention_heads"])
        elif permuted and key.endswith(("k_proj.weight", "k_proj.bias")):
            w = unpermute_qk(w, config["num_key_value_heads"])
        weights[key] = np.ascontiguousarray(w, dtype=as_dtype(dtype))
    check_weights(config, weights, path)
    return config, weights


# ---------------------------------------------------------------- tokenizer

def tokenizer_info(path_or_reader) -> dict:
    """The file's vocabulary and tokenizer metadata as plain python values."""
    reader = path_or_reader if hasattr(path_or_reader, "fields") else open_gguf(path_or_reader)
    f = reader.fields
    if "tokenizer.ggml.model" not in f:
        raise LoracError("GGUF file has no tokenizer (tokenizer.ggml.model is missing)")

    def get(key, default=None):
        return f[key].contents() if key in f else default

    return {
        "model": get("tokenizer.ggml.model"),
        "pre": get("tokenizer.ggml.pre"),
        "tokens": get("tokenizer.ggml.tokens"),
        "token_type": get("tokenizer.ggml.token_type"),
        "merges": get("tokenizer.ggml.merges"),
        "scores": get("tokenizer.ggml.scores"),
        "add_space_prefix": bool(get("tokenizer.ggml.add_space_prefix", True)),
        "bos_id": get("tokenizer.ggml.bos_token_id"),
        "eos_id": get("tokenizer.ggml.eos_token_id"),
        "add_bos": bool(get("tokenizer.ggml.add_bos_token", False)),
        "add_eos": bool(get("tokenizer.ggml.add_eos_token", False)),
        "chat_template": get("tokenizer.chat_template"),
    }


# llama.cpp's pre-tokenizer regexes (llama-vocab.cpp) for the vocabularies lorac reads.
# GPT-2's own split is the ByteLevel pre-tokenizer's default regex.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_SPLITS = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
              "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}
# smollm (and starcoder) split every digit on its own, then apply GPT-2's regex
DIGIT_FIRST = {"smollm", "starcoder", "refact"}


def build_tokenizer(info: dict):
    """A `tokenizers.Tokenizer` from GGUF vocabulary info (tokenizer_info): "gpt2" (byte-level
    BPE: SmolLM, Llama 3, Qwen2/3) here, "llama" (SentencePiece: Llama 2, Mistral) in gguf_spm.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    if info["model"] == "llama":
        from .gguf_spm import build_spm_tokenizer
        return build_spm_tokenizer(info)
    if info["model"] != "gpt2":
        raise LoracError(f"GGUF tokenizer model {info['model']!r} is not supported "
                         "(byte-level BPE 'gpt2' and SentencePiece 'llama' are)")
    tokens, merges = info["tokens"], info["merges"]
    if not merges:
        raise LoracError("GGUF byte-level tokenizer has no merges (tokenizer.ggml.merges)")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges],
                     fuse_unk=False, byte_fallback=False)
    tok = Tokenizer(bpe)
    pre = info.get("pre")
    if pre in PRE_SPLITS:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(PRE_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    elif pre in DIGIT_FIRST:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    else:  # "gpt2", "default" and unknown names: GPT-2's split
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    # Control (3) and user-defined (4) tokens match whole in raw text, as llama.cpp does.
    types = info.get("token_type") or [1] * len(tokens)
    special = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == 3]
    user = [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == 4]
    if special:
        tok.add_special_tokens(special)
    if user:
        tok.add_tokens(user)
    return tok
