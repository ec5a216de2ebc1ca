"""Apple GPUs (Metal): TVM's own DLight-scheduled kernels as Metal Shading Language.

TVM 0.27 segfaults building for Metal (NOTES.md; here: inside s_tir Tensorize, from
DLight's Matmul rule, after ~1 min on a 2-layer graph). A segfault would take the
caller's process down, so the whole build runs in a child process (ISOLATE_BUILD) and a
dead child becomes one lorac error naming the signal. A TVM that builds Metal fine
produces the artifact the same way.
"""
from __future__ import annotations


from ._gpu_generic import relax_passes  # noqa: F401 - part of the target interface
from ._common import export_shared_library as export  # noqa: F401 - target interface
from ._common import host_gpu_target
from ._common import no_environment_check as check_environment  # noqa: F401
from ._common import unchanged as prepare  # noqa: F401

FAMILY = "metal"
DEVICE = "metal"
GEMM_LIBRARY = False
DTYPES = ("float32",)

ISOLATE_BUILD = True  # pipeline.py builds in a child process and reports its death


def tvm_target(request: dict):
    return host_gpu_target("metal", request)
