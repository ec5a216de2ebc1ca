"""A TVM tensor over memory lorac allocated itself, handed to TVM through DLPack.

    t = wrap(ptr, (2, 0), (V, D), "bfloat16", release=free_fn)   # a CUDA tensor over `ptr`

The GPU reads frozen tables that wait in pinned, mapped host memory in place (runtime/devices/
cuda/mapped.py): a compiled kernel checks that its tensor's device is CUDA, and neither numpy nor
TVM makes a CUDA-typed tensor over host memory, so this builds the DLPack capsule itself (the
DLPack 0.x `dltensor` ABI, which tvm_ffi.from_dlpack takes). `release(ptr)` runs when TVM lets
the tensor go.
"""
from __future__ import annotations

import ctypes

import numpy as np

from lorac.core.dtypes import as_dtype


class _Device(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _Tensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _Device), ("ndim", ctypes.c_int32), ("dtype", _DataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


class _Managed(ctypes.Structure):
    pass


_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(_Managed))
_Managed._fields_ = [("dl_tensor", _Tensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _DELETER)]

_CODES = {"i": 0, "u": 1, "f": 2}  # kDLInt, kDLUInt, kDLFloat; bfloat16 is kDLBfloat (4)
_live: dict = {}  # address of a handed-out DLManagedTensor -> (its structures, ptr, release)


def _deleted(managed) -> None:
    structs, ptr, release = _live.pop(ctypes.addressof(managed.contents))
    if release is not None:
        release(ptr)


_deleter = _DELETER(_deleted)  # one callback for every tensor, alive as long as the module

_new_capsule = ctypes.pythonapi.PyCapsule_New
_new_capsule.restype, _new_capsule.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


def _dtype(dtype: str) -> _DataType:
    if dtype == "bfloat16":
        return _DataType(4, 16, 1)
    d = np.dtype(dtype)
    return _DataType(_CODES[d.kind], 8 * d.itemsize, 1)


class _Exporter:
    """What from_dlpack reads: the capsule of one DLManagedTensor, and its device."""

    def __init__(self, capsule, device: tuple[int, int]):
        self._capsule, self._device = capsule, device

    def __dlpack__(self, **kwargs):
        return self._capsule

    def __dlpack_device__(self):
        return self._device


def wrap(ptr: int, device: tuple[int, int], shape, dtype: str, release=None):
    """A TVM tensor of `shape` and `dtype` (C order) over the memory at `ptr` on DLPack `device`
    ((device type, id): (1, 0) the host, (2, n) CUDA device n); `release(ptr)` once TVM drops it."""
    import tvm

    shape = tuple(int(s) for s in shape)
    managed = _Managed()
    dims = (ctypes.c_int64 * max(len(shape), 1))(*shape)
    managed.dl_tensor = _Tensor(ptr, _Device(*device), len(shape), _dtype(dtype), dims, None, 0)
    managed.deleter = _deleter
    _live[ctypes.addressof(managed)] = ((managed, dims), ptr, release)
    capsule = _new_capsule(ctypes.addressof(managed), b"dltensor", None)
    return tvm.runtime.from_dlpack(_Exporter(capsule, device))


def nbytes(shape, dtype: str) -> int:
    return int(np.prod(shape)) * as_dtype(dtype).itemsize
