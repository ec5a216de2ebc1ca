"""Quantized frozen weights in a weights dict (QLoRA): each quantized weight `name` is held
as the suffixed arrays lorac.graphs.ops.quant lays out (`name.nf4` ..., `name.int8` ...,
`name.Q4_K`), never as `name`; everything else stays a dense array.

Formats and their references: nf4.py (bitsandbytes NF4), int8.py (per-channel int8),
gguf_blocks.py (llama.cpp blocks, gguf.quants). `dequantize_weights` turns a dict back into
dense float32 through those references (the `--dequantize` path and merged export).
"""
from __future__ import annotations

import numpy as np

from lorac.core.dtypes import as_dtype
from lorac.core.errors import LoracError
from lorac.graphs.ops.quant import GGUF_BLOCKS, NF4_DOUBLE, Quant, detect

from . import gguf_blocks
from . import int8
from . import nf4

QUANTIZE_KINDS = ("nf4", "int8")  # what `quantize=` makes of a dense weight on load


def suffixes(q: Quant) -> tuple[str, ...]:
    """The keys (after `name.`) a weight quantized as q is held under."""
    if q.kind == "nf4":
        return ("nf4", "nf4_code") + (NF4_DOUBLE if q.double else ("absmax",))
    if q.kind == "int8":
        return ("int8", "int8_scale")
    return (q.kind,)


def shape_of(weights: dict, name: str, q: Quant) -> tuple[int, int]:
    """(out, in) of quantized weight `name` from its arrays' shapes."""
    if q.kind == "nf4":
        out, half = np.shape(weights[f"{name}.nf4"])
        return out, 2 * half
    if q.kind == "int8":
        return tuple(np.shape(weights[f"{name}.int8"]))
    qk, nbytes = GGUF_BLOCKS[q.kind]
    out, row = np.shape(weights[f"{name}.{q.kind}"])
    return out, row // nbytes * qk


def quantize_one(w, kind: str, name: str = "weight", double: bool = True) -> dict:
    """A dense [out, in] weight -> {name.suffix: array} in format `kind`."""
    if kind == "nf4":
        arrays = nf4.quantize(w, double=double, name=name)
    elif kind == "int8":
        arrays = int8.quantize(w, name)
    elif kind in GGUF_BLOCKS:
        arrays = {kind: gguf_blocks.quantize(w, kind, name)}
    else:
        raise LoracError(f"quantization {kind!r} is not supported (supported: {', '.join(QUANTIZE_KINDS)})")
    return {f"{name}.{k}": v for k, v in arrays.items()}


def quantize_weights(weights: dict, kind: str, names) -> dict:
    """`weights` with each named dense weight replaced by its arrays in format `kind`."""
    out = dict(weights)
    for name in names:
        if name not in out:
            raise LoracError(f"tensor {name}: not a dense weight of this model; cannot quantize it")
        out.update(quantize_one(out.pop(name), kind, name))
    return out


def dense_weight(weights: dict, name: str, q: Quant | None = None) -> np.ndarray:
    """float32 [out, in] of quantized weight `name`, through its format's reference."""
    q = q or detect({k: v for k, v in weights.items() if k.startswith(name + ".")})[name]
    if q.kind == "nf4":
        return nf4.dequantize(weights, *shape_of(weights, name, q), prefix=f"{name}.")
    if q.kind == "int8":
        return int8.dequantize(weights, prefix=f"{name}.")
    return gguf_blocks.dequantize(weights[f"{name}.{q.kind}"], q.kind)


def dequantize_weights(weights: dict, dtype=np.float32) -> dict:
    """`weights` with every quantized weight dense again (in dtype; float32 by default)."""
    found = detect(weights)
    if not found:
        return weights
    out = dict(weights)
    for name, q in found.items():
        w = dense_weight(weights, name, q)
        for s in suffixes(q):
            out.pop(f"{name}.{s}")
        out[name] = w.astype(as_dtype(dtype), copy=False)
    return out


def quantized_bytes(weights: dict) -> int:
    """Bytes the quantized weights' arrays hold (all their suffixed arrays)."""
    return sum(int(np.asarray(weights[f"{n}.{s}"]).nbytes) for n, q in detect(weights).items() for s in suffixes(q))


def target_names(config: dict) -> list[str]:
    """The frozen weights of every layer's LoRA targets (the family's TARGETS, weight_name)."""
    from lorac.graphs.families import for_config
    try:
        fam = for_config(config)
    except ValueError:
        return []  # a family lorac does not train: nothing to keep quantized
    return [fam.weight_name(i, t) for i in range(int(config.get("num_hidden_layers", 0) or 0)) for t in fam.TARGETS]


def quantize_targets(config: dict, weights: dict, kind) -> dict:
    """`weights` with the LoRA targets' dense 2-D weights quantized as `kind` ("nf4": block 64,
    double-quantized absmax, as QLoRA; "int8"); kind None: unchanged. Embeddings, norms,
    lm_head and weights already quantized stay as they are."""
    if kind is None:
        return weights
    if kind not in QUANTIZE_KINDS:
        raise LoracError(f"quantize={kind!r} is not supported (supported: {', '.join(QUANTIZE_KINDS)})")
    names = [n for n in target_names(config) if n in weights and np.ndim(weights[n]) == 2]
    return quantize_weights(weights, kind, names)
