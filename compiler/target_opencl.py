"""OpenCL GPUs: TVM's own DLight-scheduled kernels for every op (no GEMM library).

Artifact: `lib.so` for an x86-64 Linux host with the OpenCL kernel source inside; the
OpenCL driver compiles it when the library is loaded on the target machine.
"""
from __future__ import annotations

from pathlib import Path

from .gpu_generic import relax_passes  # noqa: F401 - part of the target interface

FAMILY = "opencl"
DEVICE = "opencl"
GEMM_LIBRARY = False
DTYPES = ("float32",)


def tvm_target(request: dict):
    import tvm
    spec = {k: v for k, v in request.items() if k != "kind"}
    return tvm.target.Target({"kind": "opencl", **spec, "host": {"kind": "llvm"}})


def check_environment(request: dict) -> None:
    pass


def prepare(mod):
    return mod


def export(ex, art_dir: Path, target) -> dict:
    ex.export_library(str(Path(art_dir) / "lib.so"))
    return {"library": "lib.so"}
