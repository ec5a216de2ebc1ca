"""A merged GGUF (`lorac export --format gguf-merged`): the base GGUF file with the LoRA folded
into each adapted matrix, one file that llama.cpp and Ollama run without an adapter.

Every metadata key of the base is copied (architecture, hyperparameters, vocabulary, chat
template), every tensor without LoRA is copied byte for byte in its own type, and each
adapted matrix is written as W + s·B·A in `qtype` (F16 by default; BF16, F32 or Q8_0 on
request). W is the base tensor dequantized; by default the sum is not re-quantized into the
base's 4- or 5-bit type, whose steps are coarser than a LoRA update. qtype "BASE" does that on
request (the file keeps the base's size, Q4_K_M stays Q4_K_M): each adapted matrix in its base
tensor's own type, quantized as llama.cpp does (runtime/model/quant/gguf_blocks.quantize:
gguf.quants for Q4_0/Q4_1/Q5_0/Q5_1/Q8_0, llama.cpp's reference quantizers for Q4_K/Q5_K/
Q6_K); a base type lorac cannot quantize to (Q2_K, Q3_K, the IQ and TQ types) is written F16
and said so. For llama-family files the
rows of B follow llama.cpp's Q/K order, as in the GGUF adapter export (docs/EXPORT.md).
The base must be a GGUF file: an HF base goes through --format merged and then llama.cpp's
convert_hf_to_gguf.py.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import LoracError

QTYPES = ("F16", "BF16", "F32", "Q8_0", "BASE")  # BASE: each adapted matrix in its base tensor's type
FLOATS = ("F32", "F16", "BF16")


def _copy_metadata(reader, writer) -> None:
    import gguf
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == gguf.Keys.General.ARCHITECTURE:
            continue  # the writer writes these itself
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub)


def _merged_matrix(t, a, b, scale, permute_heads):
    """W + s·B·A in the file's row order, float32 [out, in]."""
    from . import llama_qk_permute
    from ..model.gguf_quant import dequantize
    shape = tuple(int(n) for n in reversed(t.shape.tolist()))
    w = dequantize(t.data, int(t.tensor_type), shape, t.name)
    if permute_heads:
        b = llama_qk_permute(np.asarray(b, np.float32), permute_heads)
    return w + scale * (np.asarray(b, np.float32) @ np.asarray(a, np.float32))


def _type_of(gguf, t, qtype: str, fallback: list):
    """The type adapted tensor t is written in: qtype, or with "BASE" its own where lorac can
    quantize to it (else F16, noted in `fallback`)."""
    from lorac.graphs.ops.quant import GGUF_BLOCKS
    if qtype != "BASE":
        return gguf.GGMLQuantizationType[qtype]
    if t.tensor_type.name in GGUF_BLOCKS or t.tensor_type.name in FLOATS:
        return t.tensor_type
    fallback.append(f"{t.name} ({t.tensor_type.name})")
    return gguf.GGMLQuantizationType.F16


def _encode(gguf, w: np.ndarray, kind, name: str) -> np.ndarray:
    from lorac.graphs.ops.quant import GGUF_BLOCKS
    from ..model.quant.gguf_blocks import quantize
    if kind.name == "F32":
        return w.astype(np.float32)
    if kind.name in GGUF_BLOCKS:
        return quantize(w, kind.name, name)
    return gguf.quants.quantize(w, kind)


def _write(gguf, path, arch, reader, by_tensor, scale, permute, qtype) -> list:
    """Write the merged file; the adapted tensors written F16 for want of their base type's quantizer."""
    writer = gguf.GGUFWriter(str(path), arch)
    _copy_metadata(reader, writer)
    fallback = []
    for t in reader.tensors:
        if t.name not in by_tensor:
            writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
            continue
        target, a, b = by_tensor[t.name]
        w = _merged_matrix(t, a, b, scale, permute.get(target)).astype(np.float32)
        kind = _type_of(gguf, t, qtype, fallback)
        writer.add_tensor(t.name, _encode(gguf, w, kind, t.name), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return fallback


def export_gguf_merged(out_path, base_gguf, lora: dict, *, alpha: float, use_rslora: bool = False,
                       qtype: str = "F16", warn=None) -> Path:
    import gguf

    from . import lora_pairs, lora_scale
    from ..model.gguf import architecture, gguf_config, metadata, open_gguf
    if qtype not in QTYPES:
        raise LoracError(f"merged GGUF tensors can be {', '.join(QTYPES)}, not {qtype}")
    if not str(base_gguf).endswith(".gguf"):
        raise LoracError("--format gguf-merged needs a GGUF base model; export an HF base with --format merged "
                         "and convert that with llama.cpp's convert_hf_to_gguf.py")
    reader = open_gguf(base_gguf)
    meta = metadata(reader)
    arch, family = architecture(meta, base_gguf)
    _, permute = family.gguf_export(gguf_config(reader, base_gguf, meta))  # {target: heads} llama.cpp permutes
    pairs = lora_pairs(lora)
    scale = lora_scale(alpha, next(iter(pairs.values()))[0].shape[0], use_rslora)
    foreign = sorted({t for _, t in pairs if t not in family.GGUF_TARGETS})
    if foreign:
        raise LoracError(f"{base_gguf}: a {arch} GGUF has no tensor for LoRA target {foreign[0]}")
    by_tensor = {f"blk.{i}.{family.GGUF_TARGETS[t]}.weight": (t, a, b) for (i, t), (a, b) in pairs.items()}
    missing = sorted(set(by_tensor) - {t.name for t in reader.tensors})
    if missing:
        raise LoracError(f"{base_gguf}: has no tensor {missing[0]} for the LoRA on it")
    from .output import staged
    out = Path(out_path)
    with staged(out, "file", fmt="gguf") as tmp:  # whole or not at all, never over a foreign file
        fallback = _write(gguf, tmp, arch, reader, by_tensor, scale, permute, qtype)
    if fallback and warn:
        more = f" and {len(fallback) - 3} more" if len(fallback) > 3 else ""
        warn(f"written F16, for lorac cannot quantize to their base types: {', '.join(fallback[:3])}{more}")
    return out
