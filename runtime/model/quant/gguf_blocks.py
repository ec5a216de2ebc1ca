"""GGUF (llama.cpp) quantized weights kept in their own blocks: `name.<TYPE>` uint8
[out, in/QK * block_bytes], the file's rows of blocks (lorac.graphs.ops.quant), and their
reference dequantization, `gguf.quants.dequantize`.

A row of a weight is a whole number of blocks, so what a family changes in a loaded tensor's
row order (llama's q/k RoPE row permutation, graphs/families/llama.py unpermute_qk) is done
on the rows of blocks, and dequantizing the permuted blocks gives exactly the permuted
dense weight that runtime/model/gguf.py loads.
"""
from __future__ import annotations

import numpy as np

from lorac.core.errors import LoracError
from lorac.graphs.ops.quant import GGUF_BLOCKS


def kind_of(ggml_type) -> str | None:
    """The type's name when lorac's graphs take it as blocks (Q4_0 ... Q6_K), else None."""
    import gguf
    try:
        name = gguf.GGMLQuantizationType(int(ggml_type)).name
    except ValueError:
        return None
    return name if name in GGUF_BLOCKS else None


def row_order(family, key: str, config: dict, out: int):
    """(keepable, rows): the row permutation the family applies to tensor `key` on load
    (None: rows unchanged), keepable False when it does more than reorder rows."""
    idx = np.arange(out, dtype=np.int64).reshape(out, 1)
    got = np.asarray(family.tensor_from_gguf(key, idx, config))
    if got.shape != (out, 1) or not np.array_equal(np.sort(got[:, 0]), idx[:, 0]):
        return False, None
    rows = got[:, 0].astype(np.int64)
    return True, None if np.array_equal(rows, idx[:, 0]) else rows


def blocks_of(raw, kind: str, out: int, inp: int, name: str, rows=None) -> np.ndarray:
    """A tensor's raw data as uint8 [out, in/QK * bytes] (a view of the file unless rows reorders it)."""
    qk, nbytes = GGUF_BLOCKS[kind]
    flat = np.asarray(raw).view(np.uint8).reshape(-1)
    if inp % qk or flat.size != out * (inp // qk) * nbytes:
        raise LoracError(f"GGUF tensor {name}: {kind} data of {flat.size} bytes does not hold {out} rows "
                         f"of {inp} values in {qk}-value blocks")
    b = flat.reshape(out, inp // qk * nbytes)
    check_scales(b, kind, name)
    return b if rows is None else np.ascontiguousarray(b[rows])


# byte offsets of each type's fp16 scales (d, and dmin or m) in its block
SCALES = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def check_scales(blocks: np.ndarray, kind: str, name: str) -> None:
    """A LoracError naming the tensor when a block's fp16 scale is inf or NaN (a corrupt file:
    the graph's fp16 decoding, lorac.graphs.ops.quant.f16, is exact for finite values only)."""
    nbytes = GGUF_BLOCKS[kind][1]
    per_block = blocks.reshape(-1, nbytes)
    for at in SCALES[kind]:
        exponent = (per_block[:, at + 1] >> 2) & 0x1F
        if (exponent == 0x1F).any():
            i = int(np.argmax(exponent == 0x1F))
            raise LoracError(f"GGUF tensor {name}: block {i} has a non-finite fp16 scale (corrupt {kind} data)")


def dequantize(blocks, kind: str, inp: int | None = None) -> np.ndarray:
    """float32 [out, in] of blocks [out, in/QK * bytes], through gguf.quants.dequantize."""
    import gguf
    qk, nbytes = GGUF_BLOCKS[kind]
    b = np.asarray(blocks, dtype=np.uint8)
    if b.ndim != 2 or b.shape[1] % nbytes or (inp is not None and b.shape[1] != inp // qk * nbytes):
        raise LoracError(f"{kind} blocks of shape {b.shape} are not rows of whole {nbytes}-byte blocks")
    return gguf.quants.dequantize(b, gguf.GGMLQuantizationType[kind]).astype(np.float32, copy=False)


def quantize(w, kind: str, name: str = "weight") -> np.ndarray:
    """A dense [out, in] weight -> uint8 blocks: gguf.quants.quantize (Q4_0, Q4_1, Q5_0, Q5_1,
    Q8_0), llama.cpp's reference quantizers in numpy for the K-quants (kquants.py)."""
    import gguf
    from . import kquants
    w = np.asarray(w)
    qk = GGUF_BLOCKS[kind][0]
    if w.ndim != 2 or w.shape[1] % qk:
        raise LoracError(f"tensor {name}: {kind} needs a 2-D weight with rows of whole {qk}-value blocks, not {w.shape}")
    if not np.isfinite(w).all():
        raise LoracError(f"tensor {name}: has non-finite values; cannot quantize it to {kind}")
    if kind in kquants.QUANTIZERS:
        return kquants.quantize(w, kind)
    return gguf.quants.quantize(w.astype(np.float32), gguf.GGMLQuantizationType[kind])
