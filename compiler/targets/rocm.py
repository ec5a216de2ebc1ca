"""AMD GPUs (ROCm): TVM's own DLight-scheduled kernels, AMDGPU code from LLVM.

TVM links AMDGPU code objects with `ld.lld` against the ROCm device bitcode libraries
(ocml/ockl, `<rocm>/amdgcn/bitcode`). Both must be on the compiling machine; without them
compile_graph stops with one error naming them (Debian: `apt-get install lld
rocm-device-libs`, or a ROCm install under /opt/rocm or $ROCM_PATH). hipBLAS dispatch
(as cuBLAS on CUDA) is not wired yet: GEMMs are TVM kernels here.
"""
from __future__ import annotations

import glob
import os
import shutil

from ._gpu_generic import relax_passes  # noqa: F401 - part of the target interface
from ._common import export_shared_library as export  # noqa: F401 - target interface
from ._common import host_gpu_target
from ._common import unchanged as prepare  # noqa: F401

FAMILY = "rocm"
DEVICE = "rocm"
GEMM_LIBRARY = False
DTYPES = ("float32",)


def tvm_target(request: dict):
    # mcpu gfx942: MI300; pass {"kind": "rocm", "mcpu": ...} for others
    return host_gpu_target("rocm", request, mcpu="gfx942")


_BITCODE_DIRS = ("{root}/amdgcn/bitcode", "{root}/lib/amdgcn/bitcode", "{root}/lib/*/amdgcn/bitcode",
                 "{root}/lib/llvm-*/lib/clang/*/lib/amdgcn/bitcode")


def _rocm_root() -> str | None:
    for root in (os.environ.get("ROCM_PATH"), "/opt/rocm", "/usr"):
        for pattern in _BITCODE_DIRS if root else ():
            if glob.glob(os.path.join(pattern.format(root=root), "ocml*.bc")):
                return root
    return None


def check_environment(request: dict) -> None:
    from lorac.core.errors import LoracError
    missing = []
    if not any(shutil.which(n) for n in ["ld.lld"] + [f"ld.lld-{v}" for v in range(20, 13, -1)]):
        missing.append("ld.lld (package lld)")
    if _rocm_root() is None:
        missing.append("the ROCm device bitcode libraries amdgcn/bitcode/ocml.bc (package rocm-device-libs, "
                       "or ROCm under /opt/rocm / $ROCM_PATH)")
    if missing:
        raise LoracError("target rocm needs " + " and ".join(missing))
