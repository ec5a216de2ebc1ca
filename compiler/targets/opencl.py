"""OpenCL GPUs: TVM's own DLight-scheduled kernels for every op (no GEMM library).

Artifact: `lib.so` for an x86-64 Linux host with the OpenCL kernel source inside; the
OpenCL driver compiles it when the library is loaded on the target machine.
"""
from __future__ import annotations


from ._gpu_generic import relax_passes  # noqa: F401 - part of the target interface
from ._common import export_shared_library as export  # noqa: F401 - target interface
from ._common import host_gpu_target
from ._common import no_environment_check as check_environment  # noqa: F401
from ._common import unchanged as prepare  # noqa: F401

FAMILY = "opencl"
DEVICE = "opencl"
GEMM_LIBRARY = False
DTYPES = ("float32",)


def tvm_target(request: dict):
    return host_gpu_target("opencl", request)
