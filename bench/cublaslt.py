"""cuBLASLt through ctypes, for bench/h200_gemm_algos.py: the GEMM that lorac's runtime issues
(runtime/devices/cuda/cublas.py: cublasGemmStridedBatchedEx, the heuristic's first pick)
described once per shape, with every candidate of cublasLtMatmulAlgoGetHeuristic runnable on
the same operands. `Shape(plan)` holds a GEMM's descriptors and candidates, `Shape.run(i, ...)`
runs candidate i.

A plan tuple is cublas._plan's: (opb, opa, n, m, k, bt, ldb, sb, at, lda, sa, ot, ldc, sc, batch),
the column-major call with cuBLAS's operand order (its A is lorac's b).
"""
from __future__ import annotations

import ctypes

from lorac.runtime.errors import LoracError

_COMPUTE_32F, _R_32F = 68, 0
_DESC_TRANSA, _DESC_TRANSB = 3, 4  # cublasLtMatmulDescAttributes_t
_LAYOUT_BATCH_COUNT, _LAYOUT_BATCH_STRIDE = 5, 6  # cublasLtMatrixLayoutAttribute_t
_PREF_MAX_WORKSPACE = 1  # cublasLtMatmulPreferenceAttributes_t
WORKSPACE = 32 << 20  # bytes: cuBLAS's own default on Hopper


class _Result(ctypes.Structure):  # cublasLtMatmulHeuristicResult_t
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspace", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


_lib = None
_handle = ctypes.c_void_p()


def _init():
    global _lib
    if _lib is not None:
        return
    from lorac.runtime.devices.cuda.cudart import load_library
    lib = load_library("libcublasLt")
    if lib.cublasLtCreate(ctypes.byref(_handle)) != 0:
        raise LoracError("cublasLtCreate failed")
    p = ctypes.c_void_p
    lib.cublasLtMatrixLayoutCreate.argtypes = [p, ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int64]
    lib.cublasLtMatmul.argtypes = [p] * 12 + [p, p, ctypes.c_size_t, p]
    lib.cublasLtMatmulAlgoGetHeuristic.argtypes = [p] * 7 + [ctypes.c_int, p, p]
    _lib = lib


def _check(status: int, what: str) -> None:
    if status != 0:
        raise LoracError(f"cuBLASLt {what} failed with status {status}")


def _set(fn, obj, attr: int, value) -> None:
    _check(fn(obj, attr, ctypes.byref(value), ctypes.sizeof(value)), "attribute")


class Shape:
    """One GEMM shape's descriptors and the heuristic's candidates (at most `count`)."""

    def __init__(self, plan: tuple, count: int = 8):
        _init()
        opb, opa, n, m, k, bt, ldb, sb, at, lda, sa, ot, ldc, sc, batch = plan
        self.desc = ctypes.c_void_p()
        _check(_lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), _COMPUTE_32F, _R_32F), "descriptor")
        _set(_lib.cublasLtMatmulDescSetAttribute, self.desc, _DESC_TRANSA, ctypes.c_int32(opb))
        _set(_lib.cublasLtMatmulDescSetAttribute, self.desc, _DESC_TRANSB, ctypes.c_int32(opa))
        # stored shapes (column-major rows x cols) of cuBLAS's A (our b), B (our a), C = D
        self.a = self._layout(bt, (k, n) if opb else (n, k), ldb, sb, batch)
        self.b = self._layout(at, (m, k) if opa else (k, m), lda, sa, batch)
        self.c = self._layout(ot, (n, m), ldc, sc, batch)
        pref = ctypes.c_void_p()
        _check(_lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "preference")
        _set(_lib.cublasLtMatmulPreferenceSetAttribute, pref, _PREF_MAX_WORKSPACE, ctypes.c_uint64(WORKSPACE))
        results, got = (_Result * count)(), ctypes.c_int()
        _check(_lib.cublasLtMatmulAlgoGetHeuristic(_handle, self.desc, self.a, self.b, self.c, self.c, pref, count,
                                                   results, ctypes.byref(got)), "heuristic")
        _lib.cublasLtMatmulPreferenceDestroy(pref)
        self.algos = [r for r in results[:got.value] if r.state == 0]
        if not self.algos:
            raise LoracError(f"cuBLASLt has no algorithm for the GEMM {plan}")

    @staticmethod
    def _layout(dtype: int, rows_cols: tuple, ld: int, stride: int, batch: int):
        out = ctypes.c_void_p()
        _check(_lib.cublasLtMatrixLayoutCreate(ctypes.byref(out), dtype, rows_cols[0], rows_cols[1], ld), "layout")
        if batch > 1:
            _set(_lib.cublasLtMatrixLayoutSetAttribute, out, _LAYOUT_BATCH_COUNT, ctypes.c_int32(batch))
            _set(_lib.cublasLtMatrixLayoutSetAttribute, out, _LAYOUT_BATCH_STRIDE, ctypes.c_int64(stride))
        return out

    def run(self, i: int, a_ptr: int, b_ptr: int, out_ptr: int, beta, workspace: int, stream) -> None:
        """out = op(a) op(b) (+ out with beta = 1) with candidate i; cuBLAS's A is our b."""
        r = self.algos[i]
        one = ctypes.c_float(1.0)
        _check(_lib.cublasLtMatmul(_handle, self.desc, ctypes.byref(one), ctypes.c_void_p(b_ptr), self.a,
                                   ctypes.c_void_p(a_ptr), self.b, ctypes.byref(beta), ctypes.c_void_p(out_ptr),
                                   self.c, ctypes.c_void_p(out_ptr), self.c, ctypes.byref(r.algo),
                                   ctypes.c_void_p(workspace), r.workspace, ctypes.c_void_p(stream)), "matmul")
