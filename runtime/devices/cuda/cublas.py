"""cuBLAS GEMMs for CUDA artifacts, through ctypes (no torch, no cupy at run time).

Contract (runtime/engine/gemm.py): row-major out[..., M, N] = op_a(a) @ op_b(b), operands bf16 or
fp32, output fp32 or bf16 (compiler/passes/gemm_output.py), accumulation fp32 (CUBLAS_COMPUTE_32F:
no TF32 shortcut for fp32).

cuBLAS is column-major. A row-major [R, C] buffer read column-major is its transpose, so
the row-major product C = A·B is computed as the column-major C^T = B^T·A^T: cuBLAS's
first operand is our `b`, its second our `a`, with m = N, n = M. A row-major operand that
is *not* transposed already reads as the transpose cuBLAS needs (op N, leading dim = its
row length); a transposed one gets op T. Batches use the strided-batched call with a
zero stride for a 2-D operand shared by every batch.
"""
from __future__ import annotations

import ctypes

from ...errors import LoracError
from .cudart import load_library, stream_getter

_OP_N, _OP_T = 0, 1
_R_32F, _R_16BF = 0, 14  # cudaDataType
_COMPUTE_32F = 68  # cublasComputeType_t
_GEMM_DEFAULT = -1
_DTYPE = {"float32": _R_32F, "bfloat16": _R_16BF}

_lib = None
_handle = None
_fn = None
_get_stream = None
_stream = [None]  # the stream the cuBLAS handle is set to
_plans: dict = {}  # (ta, tb, shapes, dtypes) -> cuBLAS arguments other than the pointers
_ONE, _ZERO = ctypes.c_float(1.0), ctypes.c_float(0.0)


def _init():
    global _lib, _handle, _fn, _get_stream
    if _handle is not None:
        return
    _lib = load_library("libcublas")
    h = ctypes.c_void_p()
    st = _lib.cublasCreate_v2(ctypes.byref(h))
    if st != 0:
        raise LoracError(f"cublasCreate failed with status {st}")
    f = _lib.cublasGemmStridedBatchedEx
    f.restype = ctypes.c_int
    i, ll, p = ctypes.c_int, ctypes.c_longlong, ctypes.c_void_p
    f.argtypes = [p, i, i, i, i, i, p, p, i, i, ll, p, i, i, ll, p, p, i, i, ll, i, i, i]
    _lib.cublasSetStream_v2.argtypes = [p, p]
    _get_stream = stream_getter()  # the GEMMs join the stream TVM launches on
    _fn, _handle = f, h


def _plan(ta: bool, tb: bool, sa: tuple, sb: tuple, so: tuple, da: str, db: str, do: str) -> tuple:
    M, N = so[-2], so[-1]
    K = sa[-2] if ta else sa[-1]
    batch = 1
    for d in so[:-2]:
        batch *= d
    # each operand's leading dimension is its own row length: a right operand may be wider than the
    # GEMM reads (a frozen weight held joined with LoRA B columns, compiler/passes/gemm_lora_k.py:
    # dY W reads its first N columns)
    stride_a = sa[-2] * sa[-1] if len(sa) > 2 else 0
    stride_b = sb[-2] * sb[-1] if len(sb) > 2 else 0
    # a shared 2-D right operand under a non-transposed batch: one tall GEMM is faster
    if len(sb) == 2 and len(sa) > 2 and not ta:
        M, batch, stride_a = M * batch, 1, 0
    return (_OP_T if tb else _OP_N, _OP_T if ta else _OP_N, N, M, K,
            _DTYPE[db], sb[-1], stride_b,
            _DTYPE[da], sa[-1], stride_a,
            _DTYPE[do], N, M * N if batch > 1 else 0, batch)


def gemm(ta: bool, tb: bool, a, b, out, accumulate: bool = False) -> None:
    """out = op(a) op(b), or out += op(a) op(b) with `accumulate` (beta = 1)."""
    if _handle is None:
        _init()
    key = (ta, tb, tuple(a.shape), tuple(b.shape), tuple(out.shape), str(a.dtype), str(b.dtype), str(out.dtype))
    plan = _plans.get(key)
    if plan is None:
        plan = _plans[key] = _plan(*key)
    stream = _get_stream(2, out.device.index)
    if stream != _stream[0]:
        _lib.cublasSetStream_v2(_handle, stream)
        _stream[0] = stream
    opb, opa, n, m, k, bt, ldb, sb, at, lda, sa, ot, ldc, sc, batch = plan
    st = _fn(_handle, opb, opa, n, m, k, ctypes.byref(_ONE),
             b.data_ptr(), bt, ldb, sb, a.data_ptr(), at, lda, sa, ctypes.byref(_ONE if accumulate else _ZERO),
             out.data_ptr(), ot, ldc, sc, batch, _COMPUTE_32F, _GEMM_DEFAULT)
    if st != 0:
        raise LoracError(f"cuBLAS GEMM failed (status {st}) for {list(a.shape)} x {list(b.shape)} -> {list(out.shape)}")
