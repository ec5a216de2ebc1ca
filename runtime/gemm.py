"""The GEMMs that compiled artifacts call, registered as TVM global functions.

The compiler (lorac.compiler.gemm) turns every matmul into a call of `lorac.gemm_<ta><tb>`
with row-major operands and a preallocated output (destination-passing style); a `t`
means "read this operand with its last two axes swapped":

    out[..., M, N] = op_a(a)[..., M, K] @ op_b(b)[..., K, N]

One registered function per layout dispatches on the output's device:
- CPU: numpy's BLAS on zero-copy DLPack views. A swapped view is only other strides,
  which numpy passes to BLAS as a transpose flag; `out=` writes into TVM's buffer.
- CUDA: cuBLAS through ctypes (gemm_cuda.py), bf16 or fp32 in, fp32 accumulate.
"""
from __future__ import annotations

import numpy as np

_CPU, _CUDA = 1, 2  # DLPack device types
_registered = False


def _cpu_gemm(ta: bool, tb: bool, a, b, out) -> None:
    x = np.from_dlpack(a)
    y = np.from_dlpack(b)
    if ta:
        x = np.swapaxes(x, -1, -2)
    if tb:
        y = np.swapaxes(y, -1, -2)
    np.matmul(x, y, out=np.from_dlpack(out))


def _layout(ta: bool, tb: bool):
    def call(a, b, out):
        if out.device.dlpack_device_type() == _CPU:
            _cpu_gemm(ta, tb, a, b, out)
        else:
            from . import gemm_cuda
            gemm_cuda.gemm(ta, tb, a, b, out)
    return call


def register() -> None:
    """Register the four layouts (once per process; override=True so a re-import of this
    module, e.g. under another package path in tests, does not fail)."""
    import tvm_ffi

    global _registered
    if _registered:
        return
    for ta in (False, True):
        for tb in (False, True):
            name = "lorac.gemm_" + ("t" if ta else "n") + ("t" if tb else "n")
            tvm_ffi.register_global_func(name, _layout(ta, tb), override=True)
    _registered = True
