"""Converters lorac puts into TVM's ONNX frontend in place of its own (units/__init__.py's
frontend_with adds them for an import)."""
from __future__ import annotations

import numpy as np


def _clip():
    import tvm
    from tvm.relax.frontend.onnx import onnx_frontend

    class Clip(onnx_frontend.Clip):
        """Clip whose constant bounds are numbers is imported as a plain maximum / minimum. TVM's
        converter guards every floating bound with where(isnan(bound), inf, bound) (ONNX treats a
        NaN bound as none), which for a constant FoldConstant then evaluates on the host: the
        NF4 dequantization's 505 clips took ~32 s of an 8B NF4 compile in that pass."""

        @staticmethod
        def _sanitize_nan_clip_bound(bb, bound, *, for_min: bool):
            if isinstance(bound, tvm.ir.GenericConst) and not np.isnan(bound.value.numpy()).any():
                return bound
            return onnx_frontend.Clip._sanitize_nan_clip_bound(bb, bound, for_min=for_min)

    return Clip


def frontend_ops() -> dict:
    """op type -> converter class, for frontend_with."""
    return {"Clip": _clip()}
