"""64-bit Arm Linux CPUs: the CPU pipeline (BLAS GEMM calls, parallel TVM kernels)
cross-compiled by LLVM and linked with Debian's `gcc-aarch64-linux-gnu` cross linker.

The target machine runs the artifact with lorac's runtime as on x86-64: numpy's BLAS
serves the GEMM calls there too.
"""
from __future__ import annotations

import shutil
from pathlib import Path

FAMILY = "aarch64"
DEVICE = "cpu"
GEMM_LIBRARY = True
ARENA_PLAN = True  # one arena for the planned tensors (compiler/memory_plan.py)
DTYPES = ("float32",)
TRIPLE = "aarch64-linux-gnu"
LINKER = "aarch64-linux-gnu-gcc"


def tvm_target(request: dict):
    import tvm
    spec = {k: v for k, v in request.items() if k != "kind"}
    spec.setdefault("mtriple", TRIPLE)
    spec.setdefault("mattr", ["+neon"])
    return tvm.target.Target({"kind": "llvm", **spec})


def check_environment(request: dict) -> None:
    from lorac.core.errors import LoracError
    if shutil.which(LINKER) is None:
        raise LoracError(f"target aarch64 needs the cross linker {LINKER} "
                         "(Debian/Ubuntu: apt-get install gcc-aarch64-linux-gnu)")


def prepare(mod):
    from .cpu import prepare as cpu_prepare  # fast exp (libm's expf is scalar here too), clipped takes
    return cpu_prepare(mod)


def native_units(dtype: str) -> dict:
    from .cpu import native_units as cpu_units  # the same scan kernels, NEON lanes
    return cpu_units(dtype)


def relax_passes(target) -> list:
    from .cpu import relax_passes as cpu_passes
    return cpu_passes(target)


def export(ex, art_dir: Path, target) -> dict:
    from tvm.support import cc
    ex.export_library(str(Path(art_dir) / "lib.so"), fcompile=cc.cross_compiler(LINKER))
    return {"library": "lib.so", "machine": "aarch64-linux-gnu"}
