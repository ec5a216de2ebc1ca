"""CPU GEMMs of compiled artifacts: numpy's BLAS on zero-copy DLPack views.

Contract (runtime/engine/gemm.py): row-major out[..., M, N] = op_a(a) @ op_b(b). A swapped
operand is only other strides, which numpy passes to BLAS as a transpose flag; `out=`
writes into TVM's buffer.

Threads: OpenBLAS's own pool spins while it waits, and next to TVM's pool (or any other
busy process) on a small machine that collapsed a 40M-model step from 2.2 s to 13 s
here. So BLAS runs single-threaded per calling thread and lorac splits each large GEMM
into row (or batch) blocks over its own small thread pool, whose idle threads block
instead of spinning (numpy releases the GIL inside matmul).
"""
from __future__ import annotations

import ctypes
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

_SPLIT_FLOPS = 8e6  # below this a GEMM runs whole: a thread hand-off costs ~20 us
_pool: ThreadPoolExecutor | None = None
_ready = False  # _setup_cpu_threads has run
_threads = 1
_blas_local = None  # openblas_set_num_threads_local, when numpy's BLAS is OpenBLAS >= 0.3.27
_tls = threading.local()


def _openblas_libs():
    """The OpenBLAS libraries this process has loaded (numpy's), as ctypes handles."""
    try:
        with open("/proc/self/maps") as f:
            paths = {ln.split()[-1] for ln in f if "openblas" in ln.lower() and ".so" in ln.split()[-1]}
    except OSError:
        return []
    libs = []
    for path in sorted(paths):
        try:
            libs.append(ctypes.CDLL(path))
        except OSError:
            continue
    return libs


def _find_openblas_local():
    """OpenBLAS's per-thread thread-count setter from the library numpy already loaded."""
    for lib in _openblas_libs():
        fn = getattr(lib, "openblas_set_num_threads_local", None)
        if fn is not None:
            fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
            return fn
    return None


def blas_info() -> str:
    """Which BLAS the CPU GEMMs run on, e.g. "OpenBLAS 0.3.31 ... SkylakeX". OpenBLAS picks
    its kernel family at load time from the CPU, unless OPENBLAS_CORETYPE names one: an
    older family set there (Haswell on an AVX-512 CPU, say) halves GEMM speed."""
    for lib in _openblas_libs():
        # plain OpenBLAS names, then numpy's bundled scipy-openblas (prefixed, 64-bit ints)
        for pre, post in (("", ""), ("scipy_", "64_"), ("scipy_", "")):
            config = getattr(lib, f"{pre}openblas_get_config{post}", None)
            core = getattr(lib, f"{pre}openblas_get_corename{post}", None)
            if config is not None and core is not None:
                break
        else:
            continue
        config.restype = core.restype = ctypes.c_char_p
        text = f"{config().decode(errors='replace').strip()} core={core().decode(errors='replace')}"
        forced = os.environ.get("OPENBLAS_CORETYPE")
        return text + (f" (OPENBLAS_CORETYPE={forced})" if forced else "")
    return "not OpenBLAS (numpy's own BLAS build)"


def _single_threaded_blas() -> None:
    if _blas_local is not None and not getattr(_tls, "single", False):
        _blas_local(1)
        _tls.single = True


def _blocks(x, y, out, n: int):
    """Split a GEMM into n independent (x, y, out) blocks: by batch, else by output rows."""
    if out.ndim > 2 and out.shape[0] >= n:
        cuts = np.linspace(0, out.shape[0], n + 1).astype(int)
        ys = [y] * n if y.ndim == 2 else [y[c0:c1] for c0, c1 in zip(cuts, cuts[1:])]
        return [(x[c0:c1], yb, out[c0:c1]) for (c0, c1), yb in zip(zip(cuts, cuts[1:]), ys)]
    rows = out.shape[-2]
    cuts = np.linspace(0, rows, n + 1).astype(int)
    return [(x[..., c0:c1, :], y, out[..., c0:c1, :]) for c0, c1 in zip(cuts, cuts[1:])]


def _cpu_gemm(ta: bool, tb: bool, a, b, out) -> None:
    x = np.from_dlpack(a)
    y = np.from_dlpack(b)
    o = np.from_dlpack(out)
    if ta:
        x = np.swapaxes(x, -1, -2)
    if tb:
        y = np.swapaxes(y, -1, -2)
    _single_threaded_blas()
    if _pool is None or 2.0 * o.size * x.shape[-1] < _SPLIT_FLOPS or o.shape[-2] < 2 * _threads:
        np.matmul(x, y, out=o)
        return
    blocks = _blocks(x, y, o, _threads)
    futures = [_pool.submit(_matmul_block, *blk) for blk in blocks[1:]]
    np.matmul(*blocks[0][:2], out=blocks[0][2])
    for f in futures:
        f.result()


def _matmul_block(x, y, out) -> None:
    _single_threaded_blas()
    np.matmul(x, y, out=out)


def _setup_cpu_threads() -> None:
    """One GEMM thread per core lorac may use (TVM_NUM_THREADS, else the CPU affinity)."""
    global _pool, _threads, _blas_local, _ready
    _ready = True
    _blas_local = _find_openblas_local()
    if _blas_local is None:
        return  # another BLAS (MKL, Accelerate): leave its own threading alone
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    _threads = max(1, int(os.environ.get("TVM_NUM_THREADS", cores)))
    if _threads > 1:
        _pool = ThreadPoolExecutor(_threads - 1, thread_name_prefix="lorac-gemm")


def gemm(ta: bool, tb: bool, a, b, out, accumulate: bool = False) -> None:
    """out = op(a) op(b), or out += op(a) op(b) with `accumulate` (DLPack tensors on the CPU)."""
    if not _ready:
        _setup_cpu_threads()
    if accumulate:
        _cpu_gemm_add(ta, tb, a, b, out)
    else:
        _cpu_gemm(ta, tb, a, b, out)


def _cpu_gemm_add(ta: bool, tb: bool, a, b, out) -> None:
    x, y, o = np.from_dlpack(a), np.from_dlpack(b), np.from_dlpack(out)
    _single_threaded_blas()
    o += np.matmul(np.swapaxes(x, -1, -2) if ta else x, np.swapaxes(y, -1, -2) if tb else y)
