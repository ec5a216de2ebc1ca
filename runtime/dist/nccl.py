"""NCCL through ctypes: the GPU gradient all-reduce of data-parallel training (no torch, no cupy).

The library is the `nvidia-nccl-cu13` wheel's libnccl.so.2 (found like cuBLAS in
runtime/devices/cuda/cublas.py). Bootstrap: rank 0 makes an ncclUniqueId (128 opaque bytes), MPI
broadcasts it, every worker joins with ncclCommInitRank on its GPU (runtime/dist/__init__.py
picks it: the local rank). Each step every flat gradient group is all-reduced in place on
TVM's current stream of that GPU (the one the training step's kernels ran on), inside one
ncclGroupStart/End. The reduction is NCCL's PreMulSum with this worker's share of the
batch's counted tokens as the host scalar: sum_r share_r * g_r, the whole batch's gradient,
without a kernel of ours. The host then waits for an event after the all-reduce, at most
--dist-timeout seconds, checking NCCL's asynchronous error state meanwhile; on a timeout or
an error the communicator is aborted and the run ends with one line.

NCCL_NVLS_ENABLE=0 stays set (NVLink multicast off; docs/DISTRIBUTED.md) unless the user
set it otherwise. The enum values and signatures are those of nccl.h (2.19 and later).
"""
from __future__ import annotations

import ctypes
import os
import time

from ..errors import LoracError

UNIQUE_ID_BYTES = 128  # NCCL_UNIQUE_ID_BYTES
FLOAT32, SUM = 7, 0  # ncclFloat32, ncclSum
SCALAR_HOST_IMMEDIATE = 1  # ncclScalarHostImmediate
IN_PROGRESS = 7  # ncclInProgress
MIN_VERSION = (2, 19, 0)  # ncclRedOpCreatePreMulSum (2.11), ncclGetLastError (2.13), CUDA 13 builds
INSTALL = "pip install 'lorac[cuda,distributed]' (the nvidia-nccl-cu13 wheel)"


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * UNIQUE_ID_BYTES)]


# name -> (restype, argtypes); pointers as c_void_p, enums as c_int
_p, _i = ctypes.c_void_p, ctypes.c_int
SIGNATURES = {
    "ncclGetVersion": (_i, [ctypes.POINTER(_i)]),
    "ncclGetErrorString": (ctypes.c_char_p, [_i]),
    "ncclGetLastError": (ctypes.c_char_p, [_p]),
    "ncclGetUniqueId": (_i, [ctypes.POINTER(UniqueId)]),
    "ncclCommInitRank": (_i, [ctypes.POINTER(_p), _i, UniqueId, _i]),
    "ncclCommGetAsyncError": (_i, [_p, ctypes.POINTER(_i)]),
    "ncclCommAbort": (_i, [_p]),
    "ncclCommDestroy": (_i, [_p]),
    "ncclGroupStart": (_i, []),
    "ncclGroupEnd": (_i, []),
    "ncclRedOpCreatePreMulSum": (_i, [ctypes.POINTER(_i), _p, _i, _i, _p]),
    "ncclRedOpDestroy": (_i, [_i, _p]),
    "ncclAllReduce": (_i, [_p, _p, ctypes.c_size_t, _i, _i, _p, _p]),
}


def version_tuple(code: int) -> tuple[int, int, int]:
    """NCCL_VERSION_CODE -> (major, minor, patch): X*1000+Y*100+Z up to 2.8, X*10000+Y*100+Z after."""
    if code < 10000:
        return code // 1000, code % 1000 // 100, code % 100
    return code // 10000, code % 10000 // 100, code % 100


class Nccl:
    """The loaded library, its functions typed; `call` turns a status into one LoracError."""

    def __init__(self, lib: ctypes.CDLL, path: str):
        self.lib, self.path = lib, path
        missing = [n for n in SIGNATURES if not hasattr(lib, n)]
        if missing:
            raise LoracError(f"{path} is not a usable NCCL: it lacks {', '.join(missing[:3])}; "
                             f"lorac needs NCCL >= {'.'.join(map(str, MIN_VERSION))}: {INSTALL}")
        for name, (res, args) in SIGNATURES.items():
            f = getattr(lib, name)
            f.restype, f.argtypes = res, args
        v = _i()
        self.call("ncclGetVersion", ctypes.byref(v))
        self.version = version_tuple(v.value)
        if self.version < MIN_VERSION:
            raise LoracError(f"{path} is NCCL {'.'.join(map(str, self.version))}; lorac needs "
                             f">= {'.'.join(map(str, MIN_VERSION))}: {INSTALL}")

    def call(self, name: str, *args, comm=None) -> None:
        status = getattr(self.lib, name)(*args)
        if status not in (0, IN_PROGRESS):
            raise LoracError(f"{name} failed: {self.describe(status, comm)}")

    def describe(self, status: int, comm=None) -> str:
        text = (self.lib.ncclGetErrorString(status) or b"").decode(errors="replace") or f"status {status}"
        detail = (self.lib.ncclGetLastError(comm) or b"").decode(errors="replace").strip()
        return f"{text} ({detail})" if detail else text

    def unique_id(self) -> bytes:
        uid = UniqueId()
        self.call("ncclGetUniqueId", ctypes.byref(uid))
        return ctypes.string_at(ctypes.addressof(uid), UNIQUE_ID_BYTES)

    def init_rank(self, nranks: int, uid: bytes, rank: int) -> ctypes.c_void_p:
        if len(uid) != UNIQUE_ID_BYTES:
            raise LoracError(f"an NCCL unique id has {UNIQUE_ID_BYTES} bytes, got {len(uid)}")
        comm = _p()
        self.call("ncclCommInitRank", ctypes.byref(comm), nranks, UniqueId.from_buffer_copy(uid), rank)
        return comm


def load(path: str | None = None) -> Nccl:
    """libnccl from the nvidia-nccl wheel (any site dir), CUDA_HOME or the loader path, or `path`."""
    from ..devices.cuda.cudart import _candidates
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    tried = [path] if path else _candidates("libnccl")
    for p in tried:
        try:
            return Nccl(ctypes.CDLL(p, mode=ctypes.RTLD_GLOBAL), p)
        except OSError:
            continue
    raise LoracError(f"multi-GPU training needs NCCL, and no libnccl was found: {INSTALL}")


class _Cudart:
    """The few CUDA runtime calls the reducer needs: pick the device, an event to wait on."""
    NOT_READY = 600  # cudaErrorNotReady

    def __init__(self):
        from ..devices.cuda.cudart import runtime
        self.lib = runtime()

    def check(self, status: int, what: str) -> None:
        if status:
            raise LoracError(f"{what} failed with CUDA error {status}")


class NcclReducer:
    """grad_reducer for CUDA engines: {group key: flat fp32 device buffer}, share -> summed in place."""

    def __init__(self, world, device: int, nccl: Nccl | None = None, cudart=None):
        self.nccl, self.cuda, self.world, self.device = nccl or load(), cudart or _Cudart(), world, device
        self.cuda.check(self.cuda.lib.cudaSetDevice(device), f"cudaSetDevice({device})")
        uid = self.world.broadcast(self.nccl.unique_id() if world.main else None, "the NCCL id")
        self.comm = self.nccl.init_rank(world.size, uid, world.rank)
        ev = _p()
        self.cuda.check(self.cuda.lib.cudaEventCreateWithFlags(ctypes.byref(ev), 2), "cudaEventCreate")  # no timing
        self.event = ev
        from ..devices.cuda.cudart import stream_getter
        self._stream = stream_getter()

    def __call__(self, flats: dict, share: float) -> None:
        nc, comm = self.nccl, self.comm
        stream = self._stream(2, self.device)  # kDLCUDA: where TVM ran the step
        op, scalar = _i(), ctypes.c_float(share)
        nc.call("ncclRedOpCreatePreMulSum", ctypes.byref(op), ctypes.byref(scalar), FLOAT32, SCALAR_HOST_IMMEDIATE,
                comm, comm=comm)
        nc.call("ncclGroupStart")
        try:
            for key in sorted(flats):  # the same order on every worker
                buf = flats[key]
                ptr = buf.data_ptr()
                nc.call("ncclAllReduce", ptr, ptr, int(buf.shape[0]), FLOAT32, op.value, comm, stream, comm=comm)
        finally:
            nc.call("ncclGroupEnd", comm=comm)
        nc.call("ncclRedOpDestroy", op.value, comm, comm=comm)
        self.cuda.check(self.cuda.lib.cudaEventRecord(self.event, stream), "cudaEventRecord")
        self._wait()

    def _wait(self) -> None:
        """Until the all-reduce is done; a peer that fails or stays away ends the run."""
        deadline, pause = time.monotonic() + self.world.timeout, 1e-5
        err = _i()
        while True:
            status = self.cuda.lib.cudaEventQuery(self.event)
            if status == 0:
                return
            if status != _Cudart.NOT_READY:
                self._abort()
                raise LoracError(f"the gradient all-reduce failed with CUDA error {status}")
            self.nccl.call("ncclCommGetAsyncError", self.comm, ctypes.byref(err), comm=self.comm)
            if err.value not in (0, IN_PROGRESS):
                why = self.nccl.describe(err.value, self.comm)
                self._abort()
                raise LoracError(f"the gradient all-reduce failed: {why}; a worker died or lost its connection")
            if time.monotonic() > deadline:
                self._abort()
                raise self.world.timed_out("the gradient all-reduce")
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)

    def _abort(self) -> None:
        if self.comm:
            self.nccl.lib.ncclCommAbort(self.comm)
            self.comm = None
