"""The CBLAS sgemm of the BLAS libraries lorac can call on the CPU, through ctypes.

- OpenBLAS: the one numpy already loaded (numpy's wheels bundle scipy-openblas, whose
  symbols carry a `scipy_` prefix and a `64_` suffix, 64-bit integers; a plain OpenBLAS
  build has the plain names).
- Intel MKL: libmkl_rt from the PyPI wheel `mkl` (in the environment's lib/), used with its
  sequential threading layer: lorac splits GEMMs over its own threads (blas.py), so no
  OpenMP runtime is loaded and nothing spins beside TVM's thread pool.

Each library is a `Cblas`: `sgemm(ta, tb, a, b, out, beta)` on float32 numpy arrays whose
last axis is contiguous (a row or column block of a larger matrix is fine: the leading
dimensions come from the strides), out[..., M, N] = op(a) op(b) + beta out.
"""
from __future__ import annotations

import ctypes
import glob
import os
import sys

_ROW, _NO, _T = 101, 111, 112
_MKL_SEQUENTIAL = 1


class Cblas:
    def __init__(self, name: str, fn, int_type, version: str, path: str, one_thread=None):
        self.name, self._fn, self.version, self.path = name, fn, version, path
        self.one_thread = one_thread  # makes the calling thread's calls single-threaded, or None
        i, p, f = ctypes.c_int, ctypes.c_void_p, ctypes.c_float
        n = int_type
        fn.argtypes = [i, i, i, n, n, n, f, p, n, p, n, f, p, n]
        fn.restype = None

    def sgemm(self, ta: bool, tb: bool, a, b, out, beta: float = 0.0) -> None:
        m, n = out.shape[-2:]
        k = a.shape[-2] if ta else a.shape[-1]
        lda, ldb, ldc = a.strides[-2] // 4, b.strides[-2] // 4, out.strides[-2] // 4
        head = (_ROW, _T if ta else _NO, _T if tb else _NO, m, n, k, 1.0)
        fn = self._fn
        if out.ndim == 2:
            fn(*head, a.ctypes.data, max(lda, 1), b.ctypes.data, max(ldb, 1), beta, out.ctypes.data, max(ldc, 1))
            return
        a3 = a.reshape(-1, *a.shape[-2:]) if a.ndim > 2 else None
        b3 = b.reshape(-1, *b.shape[-2:]) if b.ndim > 2 else None
        o3 = out.reshape(-1, m, n)
        pa, pb, po = a.ctypes.data, b.ctypes.data, o3.ctypes.data
        sa = a3.strides[0] if a3 is not None else 0
        sb = b3.strides[0] if b3 is not None else 0
        for i in range(o3.shape[0]):
            fn(*head, pa + i * sa, lda, pb + i * sb, ldb, beta, po + i * o3.strides[0], ldc)


def _loaded(pattern: str) -> list[str]:
    """Paths of the shared libraries this process has mapped whose name contains `pattern`."""
    try:
        with open("/proc/self/maps") as f:
            return sorted({ln.split()[-1] for ln in f if pattern in ln.rsplit("/", 1)[-1].lower() and ".so" in ln})
    except OSError:
        return []


def openblas() -> Cblas | None:
    """numpy's OpenBLAS (loaded with numpy), or None when numpy uses another BLAS."""
    import numpy as np
    np.dot(np.ones(2), np.ones(2))  # make sure numpy's BLAS is mapped
    for path in _loaded("openblas"):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for pre, post, int_type in (("scipy_", "64_", ctypes.c_int64), ("", "", None)):
            fn = getattr(lib, f"{pre}cblas_sgemm{post}", None)
            config = getattr(lib, f"{pre}openblas_get_config{post}", None)
            core = getattr(lib, f"{pre}openblas_get_corename{post}", None)
            if fn is None or config is None or core is None:
                continue
            config.restype = core.restype = ctypes.c_char_p
            text = config().decode(errors="replace").strip()
            if int_type is None:  # a plain build: 64-bit ints when it says so
                int_type = ctypes.c_int64 if "USE64BITINT" in text else ctypes.c_int
            version = f"{text} core={core().decode(errors='replace')}"
            forced = os.environ.get("OPENBLAS_CORETYPE")
            return Cblas("openblas", fn, int_type, version + (f" (OPENBLAS_CORETYPE={forced})" if forced else ""), path)
    return None


def openblas_thread_setter():
    """OpenBLAS's per-calling-thread thread count (>= 0.3.27), or None."""
    for path in _loaded("openblas"):
        try:
            fn = getattr(ctypes.CDLL(path), "openblas_set_num_threads_local", None)
        except OSError:
            continue
        if fn is not None:
            fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
            return fn
    return None


def _mkl_paths():
    for root in dict.fromkeys((sys.prefix, sys.base_prefix)):
        yield from sorted(glob.glob(os.path.join(root, "lib", "libmkl_rt.so*")), reverse=True)
    yield from ("libmkl_rt.so.3", "libmkl_rt.so.2", "libmkl_rt.so")  # the loader's search path


def mkl() -> Cblas | None:
    """Intel MKL's libmkl_rt (the PyPI wheel `mkl`), sequential, or None when not installed."""
    if sys.platform != "linux":
        return None
    for path in _mkl_paths():
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        layer = getattr(lib, "MKL_Set_Threading_Layer", None)
        if layer is None:
            continue
        layer.argtypes = [ctypes.c_int]
        layer(_MKL_SEQUENTIAL)  # no effect where MKL already ran (numpy built on MKL): then
        local = lib.MKL_Set_Num_Threads_Local  # each calling thread asks for one thread
        local.argtypes, local.restype = [ctypes.c_int], ctypes.c_int
        buf = ctypes.create_string_buffer(256)
        lib.MKL_Get_Version_String(buf, 256)
        return Cblas("mkl", lib.cblas_sgemm, ctypes.c_int, buf.value.decode(errors="replace").strip(), path,
                     lambda: local(1))
    return None
