"""Vulkan GPUs: TVM's own DLight-scheduled kernels as SPIR-V (no GEMM library).

The apache-tvm 0.27 wheel has no Vulkan code generator (no `target.build.vulkan`; NOTES.md),
so here the build stops at once with one error saying so; a TVM built with USE_VULKAN=ON
(and SPIRV-Tools) builds the artifact through the same passes as the other generic GPU
targets. Artifact: `lib.so` for an x86-64 Linux host with the SPIR-V inside.
"""
from __future__ import annotations

from ._gpu_generic import relax_passes  # noqa: F401 - part of the target interface
from ._common import export_shared_library as export  # noqa: F401 - target interface
from ._common import host_gpu_target
from ._common import unchanged as prepare  # noqa: F401

FAMILY = "vulkan"
DEVICE = "vulkan"
GEMM_LIBRARY = False
DTYPES = ("float32",)


def tvm_target(request: dict):
    return host_gpu_target("vulkan", request)


def check_environment(request: dict) -> None:
    import tvm  # noqa: F401 - registers the code generators this TVM was built with
    import tvm_ffi

    from lorac.core.errors import LoracError
    if tvm_ffi.get_global_func("target.build.vulkan", allow_missing=True) is None:
        raise LoracError(f"target vulkan: this TVM ({tvm.__version__}) has no Vulkan code generator "
                         "(target.build.vulkan; no apache-tvm wheel has one); build TVM with USE_VULKAN=ON")
