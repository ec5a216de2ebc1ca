"""Dtypes by name: what the compiler builds in and how numpy holds it.

The compute dtype of an artifact names its frozen weights and GEMM inputs; LoRA tensors,
optimizer state, loss and gradients are float32 in every artifact (docs/COMPILER.md).
"""
from __future__ import annotations

import numpy as np

COMPUTE_DTYPES = ("float32", "bfloat16")


def as_dtype(dtype) -> np.dtype:
    """A numpy dtype from a dtype or a name; "bfloat16" (or "bf16") is ml_dtypes' bfloat16,
    imported only when asked for (it takes ~0.1 s)."""
    if isinstance(dtype, str) and dtype.lower() in ("bfloat16", "bf16"):
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(dtype)


def is_float(dtype) -> bool:
    """Whether a numpy dtype holds floating-point values (bfloat16 included, which numpy
    itself does not count as kind "f")."""
    dtype = np.dtype(dtype)
    return dtype.kind == "f" or dtype.name == "bfloat16"
