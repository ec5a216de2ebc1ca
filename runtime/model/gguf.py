"""llama.cpp GGUF files -> an HF-style config dict, float32 weights under HF names, and a
`tokenizers.Tokenizer` built from the file's vocabulary.

GGUF keeps what HF splits over config.json, model.safetensors and tokenizer.json in one
file: metadata keys (`llama.embedding_length`, `tokenizer.ggml.tokens`, ...) and tensors
named `blk.N.attn_q.weight` etc. Dequantization lives in runtime/model/gguf_quant.py.

What differs between architectures is its model family's (graphs/families/): the
metadata -> config.json map, the tensor names, and what llama.cpp's converter changed in
the tensors. For llama-family models convert_hf_to_gguf reorders the rows of q_proj and
k_proj inside each head: HF's RoPE rotates the two halves of a head (i, i + d/2),
llama.cpp's rotates neighbours (2i, 2i+1), so the converter maps HF row (half h, i) to GGUF
row (i, h), per head (for k_proj, per KV head); `unpermute_qk` is the inverse. Qwen2/Qwen3
files are written without it (llama.cpp runs those with the NeoX, i.e. HF, rotation).
"""

import numpy as np

from lorac.core.dtypes import as_dtype

from ..errors import LoracError
from .checks import check_weights
from .gguf_quant import dequantize

# Tensors llama.cpp writes that carry no weights HF has: rope_freqs holds llama-3 style
# RoPE scaling factors, which lorac does not implement, so a file with it is refused.
UNSUPPORTED_TENSORS = {"rope_freqs.weight": "llama-3 RoPE frequency scaling (rope_freqs)"}


def open_gguf(path):
    """A `gguf.GGUFReader` on `path` (memory-mapped), or a one-line LoracError."""
    import gguf  # a hard dependency, imported here so HF-only users never pay for it

    from ..files import check_regular
    check_regular(path, "GGUF file")
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


def architecture(meta: dict, path="GGUF file") -> tuple[str, object]:
    """(gguf arch, the family module that loads it) or a LoracError naming the architecture."""
    from lorac.graphs.families import gguf_archs
    arch = meta.get("general.architecture")
    archs = gguf_archs()
    if arch not in archs:
        raise LoracError(f"{path}: GGUF architecture {arch!r} is not supported (supported: {', '.join(archs)})")
    return arch, archs[arch]


def hf_config(meta: dict, tensor_names, path="GGUF file", vocab_len=None) -> dict:
    """GGUF metadata -> the config.json dict HF would have for the same model (its family's map)."""
    from lorac.graphs.families import GgufMeta
    arch, family = architecture(meta, path)
    try:
        return family.config_from_gguf(GgufMeta(meta, arch, vocab_len), list(tensor_names))
    except ValueError as e:
        raise LoracError(f"{path}: {e}") from None


def hf_name(name: str, family=None) -> str:
    """GGUF tensor name -> HF name (`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`)
    in `family`'s naming (default: the Llama-like decoders')."""
    if family is None:
        from lorac.graphs.families import llama as family
    if name in UNSUPPORTED_TENSORS:
        raise LoracError(f"GGUF tensor {name}: {UNSUPPORTED_TENSORS[name]} is not supported")
    stem, _, kind = name.rpartition(".")
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in family.GGUF_LAYER_NAMES:
        return f"model.layers.{parts[1]}.{family.GGUF_LAYER_NAMES[parts[2]]}.{kind}"
    if stem in family.GGUF_GLOBAL_NAMES:
        return f"{family.GGUF_GLOBAL_NAMES[stem]}.{kind}"
    raise LoracError(f"GGUF tensor {name} has no HF counterpart lorac knows")


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's RoPE row order on q_proj/k_proj rows (graphs/families/llama.py)."""
    from lorac.graphs.families.llama import unpermute_qk
    return unpermute_qk(w, n_head)


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


def load_gguf(path, dtype=np.float32, quantize=None, keep_quantized=False) -> tuple[dict, dict]:
    """(HF config dict, {HF name: array}) for a GGUF file; every tensor dequantized to dtype,
    except, with keep_quantized, the LoRA targets' weights in Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K:
    those stay the file's blocks (`name.<TYPE>`, runtime/model/quant/gguf_blocks.py).
    quantize ("nf4", "int8") then quantizes the targets that are dense."""
    from .quant import quantize_targets, target_names
    from .quant import gguf_blocks
    reader = open_gguf(path)
    meta = metadata(reader)
    config = gguf_config(reader, path, meta)
    _, family = architecture(meta, path)
    keep = set(target_names(config)) if keep_quantized else set()
    weights = {}
    for t in reader.tensors:
        key = hf_name(t.name, family)
        # GGUF lists dimensions fastest-first ([in, out]); numpy wants [out, in].
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))
        kind = gguf_blocks.kind_of(t.tensor_type) if key in keep and len(shape) == 2 else None
        if kind:  # rows of blocks, reordered as the family reorders the dense rows
            keepable, rows = gguf_blocks.row_order(family, key, config, shape[0])
            if keepable:
                weights[f"{key}.{kind}"] = gguf_blocks.blocks_of(t.data, kind, *shape, t.name, rows)
                continue
        w = dequantize(t.data, int(t.tensor_type), shape, t.name)
        # the family undoes what llama.cpp's converter changed (llama's q/k row order)
        weights[key] = np.ascontiguousarray(family.tensor_from_gguf(key, w, config), dtype=as_dtype(dtype))
    check_weights(config, weights, path)
    return config, quantize_targets(config, weights, quantize)


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
