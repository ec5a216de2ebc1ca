"""Apple GPUs (Metal): TVM's own DLight-scheduled kernels as Metal Shading Language.

TVM 0.27 segfaults building for Metal (NOTES.md; here: inside s_tir Tensorize, from
DLight's Matmul rule, after ~1 min on a 2-layer graph). A segfault would take the
caller's process down, so the whole build runs in a child process (ISOLATE_BUILD) and a
dead child becomes one lorac error naming the signal. A TVM that builds Metal fine
produces the artifact the same way.
"""
from __future__ import annotations

from pathlib import Path

from .gpu_generic import relax_passes  # noqa: F401 - part of the target interface

FAMILY = "metal"
DEVICE = "metal"
GEMM_LIBRARY = False
DTYPES = ("float32",)

ISOLATE_BUILD = True  # pipeline.py builds in a child process and reports its death


def tvm_target(request: dict):
    import tvm
    spec = {k: v for k, v in request.items() if k != "kind"}
    return tvm.target.Target({"kind": "metal", **spec, "host": {"kind": "llvm"}})


def check_environment(request: dict) -> None:
    pass


def prepare(mod):
    return mod


def export(ex, art_dir: Path, target) -> dict:
    ex.export_library(str(Path(art_dir) / "lib.so"))
    return {"library": "lib.so"}
