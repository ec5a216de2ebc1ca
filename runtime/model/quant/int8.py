"""int8, symmetric per output channel: `name.int8` int8 [out, in], `name.int8_scale` float32
[out]; w = q * scale[:, None].

scale = max|row| / 127 in float32, q = round-half-even(w / scale) clipped to [-127, 127].
An all-zero row gets scale 1.0 (its q are all 0, so it dequantizes to exact zeros, and no
row ever has a zero or non-finite scale). The error of a value is at most scale / 2.
"""
from __future__ import annotations

import numpy as np

from lorac.core.errors import LoracError


def quantize(w, name: str = "weight") -> dict:
    """A dense [out, in] weight -> {"int8": int8 [out, in], "int8_scale": float32 [out]}."""
    w = np.asarray(w)
    if w.ndim != 2:
        raise LoracError(f"tensor {name}: int8 quantizes 2-D weights, not shape {w.shape}")
    x = w.astype(np.float32)
    if not np.isfinite(x).all():
        raise LoracError(f"tensor {name}: has non-finite values; cannot quantize it")
    rowmax = np.abs(x).max(axis=1)
    scale = np.where(rowmax > 0, rowmax / np.float32(127), np.float32(1)).astype(np.float32)
    q = np.clip(np.rint(x / scale[:, None]), -127, 127).astype(np.int8)
    return {"int8": q, "int8_scale": scale}


def dequantize(arrays: dict, prefix: str = "") -> np.ndarray:
    q = np.asarray(arrays[prefix + "int8"])
    scale = np.asarray(arrays[prefix + "int8_scale"], np.float32)
    if q.ndim != 2 or scale.shape != (q.shape[0],):
        raise LoracError(f"tensor {prefix.rstrip('.') or 'int8'}: int8 {q.shape} and scale {scale.shape} do not match")
    return q.astype(np.float32) * scale[:, None]
