"""CPU GEMMs of compiled artifacts: a CBLAS sgemm on zero-copy DLPack views, the fastest
library and split of each GEMM shape chosen once on this machine.

Contract (runtime/engine/gemm.py): row-major out[..., M, N] = op_a(a) @ op_b(b), or
out += ... for the accumulating calls. A swapped operand is a CBLAS transpose flag; the
library writes into TVM's buffer (beta = 1 accumulates in place).

Libraries (cblas.py): numpy's OpenBLAS always, Intel MKL when the PyPI wheel `mkl` is
installed (sequential); numpy's np.matmul where numpy has no OpenBLAS. Threads: a BLAS's
own pool spins while it waits, and next to TVM's pool (or any other busy process) on a
small machine that collapsed a 40M-model step from 2.2 s to 13 s here. So every library
runs single-threaded per calling thread and lorac splits a large GEMM into blocks of
output rows (or batches), or of output columns, over its own small thread pool, whose idle
threads block instead of spinning (ctypes and numpy release the GIL inside the call).

Choice (choice.py): a GEMM of at least _SPLIT_FLOPS is split over every thread, by rows or
by columns, a smaller one runs whole; the first time a process meets a GEMM shape it runs
each (library, split) on the call's own operands, interleaved, and keeps the one that took
the least CPU time; the choices are
stored per machine and library versions in the artifact cache's .lorac-tuning/cpu-gemm.json
(use_cache_dir, called when an artifact is opened), so later runs skip the timing.
LORAC_CPU_BLAS=openblas|mkl|numpy restricts the choice to one library (benchmarks, tests).
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from . import cblas
from . import choice

_SPLIT_FLOPS = 8e6  # below this a GEMM runs whole: a thread hand-off costs ~20 us
_pool: ThreadPoolExecutor | None = None
_ready = False  # _setup has run
_threads = 1
_libs: dict = {}  # name -> library (cblas.Cblas or _Numpy)
_blas_local = None  # openblas_set_num_threads_local, when numpy's BLAS is OpenBLAS >= 0.3.27
_tls = threading.local()
_lock = threading.Lock()


class _Numpy:
    """np.matmul, for a numpy without OpenBLAS (macOS Accelerate, say): whole GEMMs only."""
    name, version, path = "numpy", f"numpy {np.__version__}", ""

    def sgemm(self, ta, tb, a, b, out, beta=0.0):
        x, y = (np.swapaxes(a, -1, -2) if ta else a), (np.swapaxes(b, -1, -2) if tb else b)
        if beta:
            out += np.matmul(x, y)
        else:
            np.matmul(x, y, out=out)


def blas_info() -> str:
    """The libraries the CPU GEMMs choose from, e.g. "openblas: OpenBLAS 0.3.31 ... SkylakeX;
    mkl: Intel(R) oneAPI ...". OpenBLAS picks its kernel family at load time from the CPU,
    unless OPENBLAS_CORETYPE names one: an older family set there (Haswell on an AVX-512 CPU,
    say) halves GEMM speed."""
    if not _ready:
        _setup()
    return "; ".join(f"{n}: {lib.version}" for n, lib in _libs.items()) + f" ({_threads} threads)"


def _single_threaded() -> None:
    """Once per calling thread: every library runs this thread's calls on it alone."""
    if not getattr(_tls, "single", False):
        if _blas_local is not None:
            _blas_local(1)
        for lib in _libs.values():
            if getattr(lib, "one_thread", None) is not None:
                lib.one_thread()
        _tls.single = True


def _setup() -> None:
    """The libraries, one GEMM thread per core lorac may use (TVM_NUM_THREADS, else the CPU affinity)."""
    global _pool, _threads, _blas_local, _ready, _libs
    with _lock:
        if _ready:
            return
        only = os.environ.get("LORAC_CPU_BLAS", "").strip().lower()
        found = {"openblas": cblas.openblas, "mkl": cblas.mkl}
        libs = {}
        for name, load in found.items():
            if not only or only == name:
                lib = load()
                if lib is not None:
                    libs[name] = lib
        if not libs:
            libs["numpy"] = _Numpy()
        _blas_local = cblas.openblas_thread_setter()
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:
            cores = os.cpu_count() or 1
        _threads = max(1, int(os.environ.get("TVM_NUM_THREADS", cores)))
        if _blas_local is None and "openblas" in libs or "numpy" in libs:
            _threads = 1  # a BLAS that threads by itself: leave its own threading alone
        if _threads > 1:
            _pool = ThreadPoolExecutor(_threads - 1, thread_name_prefix="lorac-gemm")
        _libs = libs
        choice.configure("; ".join(f"{n}={lib.version}" for n, lib in libs.items()) + f"; threads={_threads}")
        _ready = True


def use_cache_dir(path) -> None:
    """Keep this machine's GEMM choices in `path`/cpu-gemm.json (an artifact cache's .lorac-tuning)."""
    if not _ready:
        _setup()
    choice.set_file(path)


def _flat(x):
    """A contiguous operand with its batch dims merged into one (a view)."""
    return x.reshape(-1, *x.shape[-2:]) if x.ndim > 3 else x


def _blocks(mode: str, ta: bool, tb: bool, x, y, out, n: int):
    """Split a GEMM into n independent (x, y, out) blocks: by batch or output rows ("rows"),
    or by output columns ("cols")."""
    if mode == "rows" and out.ndim == 3 and out.shape[0] >= n:
        cuts = np.linspace(0, out.shape[0], n + 1).astype(int)
        return [(x[c0:c1] if x.ndim == 3 else x, y[c0:c1] if y.ndim == 3 else y, out[c0:c1])
                for c0, c1 in zip(cuts, cuts[1:])]
    if mode == "rows":
        cuts = np.linspace(0, out.shape[-2], n + 1).astype(int)
        return [(x[..., :, c0:c1] if ta else x[..., c0:c1, :], y, out[..., c0:c1, :]) for c0, c1 in zip(cuts, cuts[1:])]
    cuts = np.linspace(0, out.shape[-1], n + 1).astype(int)
    return [(x, y[..., c0:c1, :] if tb else y[..., :, c0:c1], out[..., :, c0:c1]) for c0, c1 in zip(cuts, cuts[1:])]


def _run(plan: tuple[str, str], ta: bool, tb: bool, x, y, out, beta: float) -> None:
    lib = _libs[plan[0]]
    if plan[1] == "whole":
        lib.sgemm(ta, tb, x, y, out, beta)
        return
    blocks = _blocks(plan[1], ta, tb, x, y, out, _threads)
    futures = [_pool.submit(_block, lib, ta, tb, *blk, beta) for blk in blocks[1:]]
    lib.sgemm(ta, tb, *blocks[0], beta)
    for f in futures:
        f.result()


def _block(lib, ta, tb, x, y, out, beta) -> None:
    _single_threaded()
    lib.sgemm(ta, tb, x, y, out, beta)


def _candidates(ta: bool, tb: bool, x, out) -> list[tuple[str, str]]:
    m, n = out.shape[-2:]
    k = x.shape[-2] if ta else x.shape[-1]
    modes = []  # a large GEMM is split over every thread, a small one runs whole
    if _pool is not None and 2.0 * out.size * k >= _SPLIT_FLOPS:
        if m >= 2 * _threads or (out.ndim == 3 and out.shape[0] >= _threads):
            modes.append("rows")
        if n >= 2 * _threads:
            modes.append("cols")
    modes = modes or ["whole"]
    return [(lib, mode) for lib in _libs for mode in modes if lib != "numpy" or mode == "whole"]


def shape_key(ta: bool, tb: bool, a_shape, b_shape, accumulate: bool) -> str:
    """The choice's key: layout and operand shapes (batch dims merged), e.g. "nt 1024x512 1408x512"."""
    a_shape, b_shape = (tuple(s) if len(s) <= 3 else (-1, *s[-2:]) for s in (a_shape, b_shape))
    return (f"{'t' if ta else 'n'}{'t' if tb else 'n'} {'x'.join(map(str, a_shape))} {'x'.join(map(str, b_shape))}"
            + (" +=" if accumulate else ""))


def gemm(ta: bool, tb: bool, a, b, out, accumulate: bool = False) -> None:
    """out = op(a) op(b), or out += op(a) op(b) with `accumulate` (DLPack tensors on the CPU)."""
    if not _ready:
        _setup()
    _single_threaded()
    x, y, o = _flat(np.from_dlpack(a)), _flat(np.from_dlpack(b)), _flat(np.from_dlpack(out))
    key = shape_key(ta, tb, x.shape, y.shape, accumulate)
    plan = choice.get(key)
    if plan is None:
        cands = _candidates(ta, tb, x, o)
        if len(cands) == 1:
            plan = choice.remember(key, cands[0])
        else:
            plan = choice.pick(key, cands, lambda c: _run(c, ta, tb, x, y, o, 0.0), o if accumulate else None)
    _run(plan, ta, tb, x, y, o, 1.0 if accumulate else 0.0)
