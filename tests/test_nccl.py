"""runtime/dist/nccl.py without a GPU: its ctypes bindings against a stand-in libnccl built here
from C with nccl.h's types (ncclUniqueId passed by value, size_t counts, enum values, the
PreMulSum scalar read through its pointer), and its one-line errors for a missing, foreign or
too old library. The stand-in's all-reduce over one rank is the pre-multiplied copy NCCL
makes of it. The real library runs only on the GPU machine (bench/dp_gpu_session.sh)."""
import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from lorac.runtime.dist import nccl
from lorac.runtime.errors import LoracError

STUB = r"""
#include <stddef.h>
typedef struct { char internal[128]; } ncclUniqueId;
static float scalars[16]; static int n_ops = 0; static int grouped = 0;
int ncclGetVersion(int* v) { *v = VERSION; return 0; }
const char* ncclGetErrorString(int r) { return r == 5 ? "invalid usage" : "unhandled error"; }
const char* ncclGetLastError(void* comm) { return "the stand-in refused"; }
int ncclGetUniqueId(ncclUniqueId* u) { for (int i = 0; i < 128; i++) u->internal[i] = (char)(i * 7); return 0; }
int ncclCommInitRank(void** comm, int n, ncclUniqueId id, int rank) {
  for (int i = 0; i < 128; i++) if (id.internal[i] != (char)(i * 7)) return 5;  /* the id arrived whole */
  if (n != 1 || rank != 0) return 5;
  *comm = (void*)0x10; return 0; }
int ncclCommGetAsyncError(void* comm, int* e) { *e = 0; return 0; }
int ncclCommAbort(void* comm) { return 0; }
int ncclCommDestroy(void* comm) { return 0; }
int ncclGroupStart(void) { grouped++; return 0; }
int ncclGroupEnd(void) { grouped--; return 0; }
int ncclRedOpCreatePreMulSum(int* op, void* scalar, int dtype, int residence, void* comm) {
  if (dtype != 7 || residence != 1 || comm != (void*)0x10) return 4;
  scalars[n_ops % 16] = *(float*)scalar; *op = 5 + n_ops % 16; n_ops++; return 0; }
int ncclRedOpDestroy(int op, void* comm) { return op >= 5 ? 0 : 4; }
int ncclAllReduce(const void* s, void* r, size_t n, int dtype, int op, void* comm, void* stream) {
  if (dtype != 7 || op < 5 || !grouped) return 5;
  for (size_t i = 0; i < n; i++) ((float*)r)[i] = scalars[op - 5] * ((const float*)s)[i];
  return 0; }
"""


def _build(tmp_path: Path, version: int, drop: str = "") -> str:
    if not shutil.which("cc"):
        pytest.skip("no C compiler for the stand-in libnccl")
    src = tmp_path / f"stub{version}{drop}.c"
    src.write_text(STUB.replace(f"int {drop}(", f"int unused_{drop}(") if drop else STUB)
    lib = tmp_path / f"libnccl_stub{version}{drop}.so"
    subprocess.run(["cc", "-shared", "-fPIC", f"-DVERSION={version}", "-o", str(lib), str(src)], check=True)
    return str(lib)


def test_missing_foreign_and_old_libraries_are_one_line(tmp_path):
    with pytest.raises(LoracError, match=r"no libnccl was found: pip install 'lorac\[cuda,distributed\]'"):
        nccl.load(str(tmp_path / "libnccl.so.2"))
    with pytest.raises(LoracError, match="is not a usable NCCL: it lacks ncclRedOpCreatePreMulSum"):
        nccl.load(_build(tmp_path, 23203, drop="ncclRedOpCreatePreMulSum"))
    with pytest.raises(LoracError, match=r"is NCCL 2\.10\.3; lorac needs >= 2\.19\.0"):
        nccl.load(_build(tmp_path, 21003))
    assert nccl.version_tuple(2708) == (2, 7, 8) and nccl.version_tuple(23203) == (2, 32, 3)
    assert ctypes.sizeof(nccl.UniqueId) == 128


class _World:
    size, rank, main, timeout = 1, 0, True, 5.0

    def broadcast(self, data, what):
        return data

    def timed_out(self, what):
        return LoracError(what)


class _Cudart:
    class lib:  # noqa: N801 - stands in for the ctypes library
        cudaSetDevice = cudaEventCreateWithFlags = cudaEventRecord = cudaEventQuery = staticmethod(lambda *a: 0)

    @staticmethod
    def check(status, what):
        assert status == 0


class _Flat:
    """A flat gradient buffer as the reducer sees a TVM tensor: shape and data_ptr."""

    def __init__(self, a):
        self.a, self.shape = a, a.shape

    def data_ptr(self):
        return self.a.ctypes.data


def test_the_reducer_drives_nccl_through_the_right_signatures(tmp_path):
    lib = nccl.load(_build(tmp_path, 23203))
    assert lib.version == (2, 32, 3)
    uid = lib.unique_id()
    assert len(uid) == 128 and uid[:3] == bytes([0, 7, 14])
    with pytest.raises(LoracError, match=r"ncclCommInitRank failed: invalid usage \(the stand-in refused\)"):
        lib.init_rank(1, bytes(128), 0)  # an id that is not the one made: the library says so, in one line
    with pytest.raises(LoracError, match="128 bytes"):
        lib.init_rank(1, b"short", 0)
    red = nccl.NcclReducer(_World(), 0, nccl=lib, cudart=_Cudart())
    flats = {"lora_A": np.arange(5, dtype=np.float32), "lora_B": np.full(3, 2.0, np.float32)}
    red({k: _Flat(v) for k, v in flats.items()}, 0.25)
    assert flats["lora_A"].tolist() == [0, 0.25, 0.5, 0.75, 1.0] and flats["lora_B"].tolist() == [0.5] * 3
