"""The CUDA libraries lorac calls through ctypes (no torch, no cupy at run time): where they are
found, the CUDA runtime with the signatures of every call lorac makes, and the stream TVM launches on.

    lib = load_library("libcublas")   # pip's nvidia-* wheels, CUDA_HOME, then the loader's path
    rt = runtime()                    # libcudart, argtypes set once for the calls below
    stream = stream_getter()(2, device_index)  # kDLCUDA: the stream TVM's kernels go to (a capture stream
                                               # while a CUDA graph records)
"""
from __future__ import annotations

import ctypes
import glob
import os
import sys

from ...errors import LoracError

_P, _SIZE, _INT, _UINT = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_uint
# every CUDA runtime call of lorac's runtime, with its argument types (all return cudaError_t)
SIGNATURES = {
    "cudaSetDevice": [_INT],
    "cudaMemGetInfo": [ctypes.POINTER(_SIZE), ctypes.POINTER(_SIZE)],
    "cudaMalloc": [ctypes.POINTER(_P), _SIZE],
    "cudaHostAlloc": [ctypes.POINTER(_P), _SIZE, _UINT],
    "cudaHostGetDevicePointer": [ctypes.POINTER(_P), _P, _UINT],
    "cudaFreeHost": [_P],
    "cudaMemcpyAsync": [_P, _P, _SIZE, _INT, _P],
    "cudaStreamCreateWithFlags": [ctypes.POINTER(_P), _UINT],
    "cudaStreamWaitEvent": [_P, _P, _UINT],
    "cudaEventCreateWithFlags": [ctypes.POINTER(_P), _UINT],
    "cudaEventRecord": [_P, _P],
    "cudaEventQuery": [_P],
    "cudaEventDestroy": [_P],
}
_loaded: dict = {}  # "runtime" -> the CDLL, "stream" -> TVMFFIEnvGetStream


def _candidates(name: str) -> list[str]:
    """`name` from pip's nvidia-* wheels (any site dir), CUDA_HOME, then the loader path."""
    out = []
    for base in sys.path:
        out += sorted(glob.glob(os.path.join(base, "nvidia", "*", "lib", name + ".so*")), reverse=True)
    for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if home:
            out += sorted(glob.glob(os.path.join(home, "lib64", name + ".so*")), reverse=True)
    return out + [name + ".so.13", name + ".so.12", name + ".so"]


def load_library(name: str) -> ctypes.CDLL:
    for path in _candidates(name):
        try:
            return ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
    raise LoracError(f"CUDA artifact needs {name} (CUDA toolkit or the nvidia pip wheels); not found")


def runtime() -> ctypes.CDLL:
    """libcudart, loaded once, each call of SIGNATURES typed."""
    if "runtime" not in _loaded:
        lib = load_library("libcudart")
        for name, args in SIGNATURES.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = _INT, args
        _loaded["runtime"] = lib
    return _loaded["runtime"]


def stream_getter():
    """TVMFFIEnvGetStream(device_type, device_id): the stream TVM launches its kernels on. The GEMMs,
    cuDNN's attention and the offload copies must join that same stream (a capture stream while a
    CUDA graph records)."""
    if "stream" not in _loaded:
        import tvm_ffi
        fn = tvm_ffi.LIB.TVMFFIEnvGetStream
        fn.restype, fn.argtypes = ctypes.c_void_p, [ctypes.c_int32, ctypes.c_int32]
        _loaded["stream"] = fn
    return _loaded["stream"]
