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

Algorithm (LORAC_CUDA_GEMM, default `tuned`): cublasGemmStridedBatchedEx runs the heuristic's
first pick. The first time a process meets a GEMM shape outside a CUDA-graph capture (TVM runs
every captured function once before capturing it), that call is timed against cuBLASLt's
other candidates for the shape (cublaslt.py) on the call's own operands and a scratch output,
and the fastest is kept when it beats cuBLAS's own pick by at least 3 %. The choices are stored
per GPU and cuBLAS version in the artifact cache's .lorac-tuning/cuda-gemm.json (use_cache_dir,
called when an artifact is opened), so a later run makes the same choices without timing:
its results are the same bit for bit. `LORAC_CUDA_GEMM=default` keeps cuBLAS's own pick for
every shape.
"""
from __future__ import annotations

import ctypes
import glob
import os
import sys

from ...errors import LoracError
from .._choices import Choices

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
CANDIDATES, MARGIN = 8, 0.97  # cuBLASLt candidates timed; a winner's time at most MARGIN x cuBLAS's own
_MISSING = object()
_resolved: dict = {}  # plan key -> None (cuBLAS's own pick) or (cublaslt.Shape, candidate)
_cudart = None
_workspace = [None]  # cuBLASLt's workspace (cublaslt.WORKSPACE bytes), made at its first use


def _decode(text: str):
    if text == "default" or (text.startswith("lt:") and len(text) == 3 + 128):
        return text
    return None  # not a value of this file: timed anew


_store = Choices("cuda-gemm.json", decode=_decode)  # shape key -> "default" | "lt:<the algorithm's 64 bytes>"


def _candidates(name: str) -> list[str]:
    """libcublas from pip's nvidia-* wheels (any site dir), CUDA_HOME, then the loader path."""
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
    # TVM launches its kernels on the stream TVMFFIEnvGetStream names (a capture stream
    # while a CUDA graph records); the GEMMs must join that same stream
    import tvm_ffi
    _get_stream = tvm_ffi.LIB.TVMFFIEnvGetStream
    _get_stream.restype, _get_stream.argtypes = ctypes.c_void_p, [ctypes.c_int32, ctypes.c_int32]
    _fn, _handle = f, h


def _plan(ta: bool, tb: bool, sa: tuple, sb: tuple, so: tuple, da: str, db: str, do: str) -> tuple:
    M, N = so[-2], so[-1]
    K = sa[-2] if ta else sa[-1]
    batch = 1
    for d in so[:-2]:
        batch *= d
    stride_a = M * K if len(sa) > 2 else 0
    stride_b = K * N if len(sb) > 2 else 0
    # a shared 2-D right operand under a non-transposed batch: one tall GEMM is faster
    if len(sb) == 2 and len(sa) > 2 and not ta:
        M, batch, stride_a = M * batch, 1, 0
    return (_OP_T if tb else _OP_N, _OP_T if ta else _OP_N, N, M, K,
            _DTYPE[db], K if tb else N, stride_b,
            _DTYPE[da], M if ta else K, stride_a,
            _DTYPE[do], N, M * N if batch > 1 else 0, batch)


def shape_key(key: tuple, accumulate: bool) -> str:
    """The stored choice's key, e.g. "nt 8192x4096 1024x4096 bfloat16,bfloat16->bfloat16 +="."""
    ta, tb, sa, sb, _, da, db, do = key
    return (f"{'t' if ta else 'n'}{'t' if tb else 'n'} {'x'.join(map(str, sa))} {'x'.join(map(str, sb))} "
            f"{da},{db}->{do}" + (" +=" if accumulate else ""))


def use_cache_dir(folder, gpu: str) -> None:
    """Keep the algorithm choices of `gpu` (its name) in `folder`/cuda-gemm.json."""
    if _handle is None:
        _init()
    version = ctypes.c_int()
    _lib.cublasGetVersion_v2(_handle, ctypes.byref(version))
    section = f"{gpu}; cuBLAS {version.value}"
    if _store.section != section:
        _store.configure(section)
    _store.set_file(folder)


def _runtime():
    global _cudart
    if _cudart is None:
        _cudart = load_library("libcudart")
        p = ctypes.c_void_p
        for name, args in (("cudaMalloc", [p, ctypes.c_size_t]), ("cudaFree", [p]), ("cudaEventCreate", [p]),
                           ("cudaEventRecord", [p, p]), ("cudaEventSynchronize", [p]), ("cudaEventDestroy", [p]),
                           ("cudaEventElapsedTime", [p, p, p]), ("cudaStreamIsCapturing", [p, p])):
            getattr(_cudart, name).argtypes = args
    return _cudart


def _malloc(size: int) -> int:
    ptr = ctypes.c_void_p()
    if _runtime().cudaMalloc(ctypes.byref(ptr), size) != 0:
        raise LoracError(f"out of GPU memory for a cuBLAS buffer of {size >> 20} MiB")
    return ptr.value


def _lt_workspace() -> int:
    if _workspace[0] is None:
        from . import cublaslt
        _workspace[0] = _malloc(cublaslt.WORKSPACE)
    return _workspace[0]


def _capturing(stream) -> bool:
    status = ctypes.c_int()
    return _runtime().cudaStreamIsCapturing(ctypes.c_void_p(stream), ctypes.byref(status)) != 0 or status.value != 0


def _lt(plan: tuple, algo: str):
    """(cublaslt.Shape, candidate) for a stored algorithm, or None where the heuristic no longer lists it."""
    from . import cublaslt
    shape = cublaslt.Shape(plan, CANDIDATES)
    found = [i for i, r in enumerate(shape.algos) if bytes(r.algo).hex() == algo]
    return (shape, found[0]) if found else None


def _resolve(key: tuple, plan: tuple, accumulate: bool, a, b, out, stream):
    """How `key` runs: None (cuBLAS's own pick) or (cublaslt.Shape, candidate); stored, or timed now."""
    if os.environ.get("LORAC_CUDA_GEMM", "tuned") == "default":
        _resolved[key] = None
        return None
    skey = shape_key(key[:8], accumulate)
    stored = _store.get(skey)
    if stored == "default":
        _resolved[key] = None
        return None
    if stored is not None:
        run = _lt(plan, stored[3:])
        if run is not None:
            _resolved[key] = run
            return run
    if _capturing(stream):
        return None  # nothing can be timed inside a capture: cuBLAS's own pick, and timed at a later call
    run = _time(plan, accumulate, a, b, out, stream)
    _store.keep(skey, "default" if run is None else "lt:" + bytes(run[0].algos[run[1]].algo).hex())
    _resolved[key] = run
    return run


def _time(plan: tuple, accumulate: bool, a, b, out, stream):
    """The fastest of cuBLAS's own pick and cuBLASLt's candidates, on a scratch output; None: cuBLAS's."""
    from . import cublaslt
    shape = cublaslt.Shape(plan, CANDIDATES)
    nbytes = ctypes.sizeof(ctypes.c_float if str(out.dtype) == "float32" else ctypes.c_uint16)
    for d in out.shape:
        nbytes *= d
    rt, scratch, ws = _runtime(), _malloc(nbytes), _lt_workspace()
    beta = _ONE if accumulate else _ZERO
    runs = [lambda: _gemm_ex(plan, a.data_ptr(), b.data_ptr(), scratch, beta)]
    runs += [lambda i=i: shape.run(i, a.data_ptr(), b.data_ptr(), scratch, beta, ws, stream)
             for i in range(len(shape.algos))]
    events = [ctypes.c_void_p(), ctypes.c_void_p()]
    for e in events:
        rt.cudaEventCreate(ctypes.byref(e))
    best = [float("inf")] * len(runs)
    try:
        for _ in range(2):  # rounds, interleaved: a clock change hits every candidate alike
            for i, run in enumerate(runs):
                run()  # warm
                rt.cudaEventRecord(events[0], ctypes.c_void_p(stream))
                for _ in range(3):
                    run()
                rt.cudaEventRecord(events[1], ctypes.c_void_p(stream))
                rt.cudaEventSynchronize(events[1])
                ms = ctypes.c_float()
                rt.cudaEventElapsedTime(ctypes.byref(ms), events[0], events[1])
                best[i] = min(best[i], ms.value)
    finally:
        for e in events:
            rt.cudaEventDestroy(e)
        rt.cudaFree(ctypes.c_void_p(scratch))
    fastest = min(range(1, len(runs)), key=best.__getitem__)
    return (shape, fastest - 1) if best[fastest] < MARGIN * best[0] else None


def _gemm_ex(plan: tuple, a_ptr: int, b_ptr: int, out_ptr: int, beta) -> None:
    opb, opa, n, m, k, bt, ldb, sb, at, lda, sa, ot, ldc, sc, batch = plan
    st = _fn(_handle, opb, opa, n, m, k, ctypes.byref(_ONE), b_ptr, bt, ldb, sb, a_ptr, at, lda, sa,
             ctypes.byref(beta), out_ptr, ot, ldc, sc, batch, _COMPUTE_32F, _GEMM_DEFAULT)
    if st != 0:
        raise LoracError(f"cuBLAS GEMM failed (status {st}) for the column-major {m}x{n}x{k} call of plan {plan}")


def gemm(ta: bool, tb: bool, a, b, out, accumulate: bool = False) -> None:
    """out = op(a) op(b), or out += op(a) op(b) with `accumulate` (beta = 1)."""
    if _handle is None:
        _init()
    key = (ta, tb, tuple(a.shape), tuple(b.shape), tuple(out.shape), str(a.dtype), str(b.dtype), str(out.dtype),
           accumulate)
    plan = _plans.get(key)
    if plan is None:
        plan = _plans[key] = _plan(*key[:8])
    stream = _get_stream(2, out.device.index)
    if stream != _stream[0]:
        _lib.cublasSetStream_v2(_handle, stream)
        _stream[0] = stream
    run = _resolved.get(key, _MISSING)
    if run is _MISSING:
        run = _resolve(key, plan, accumulate, a, b, out, stream)
    if run is None:
        _gemm_ex(plan, a.data_ptr(), b.data_ptr(), out.data_ptr(), _ONE if accumulate else _ZERO)
    else:
        run[0].run(run[1], a.data_ptr(), b.data_ptr(), out.data_ptr(), _ONE if accumulate else _ZERO,
                   _lt_workspace(), stream)
