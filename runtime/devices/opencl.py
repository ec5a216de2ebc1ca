"""OpenCL GPUs: artifacts of target opencl (TVM's own kernels, OpenCL C compiled by the
driver when the library loads). Runs only in a TVM built with USE_OPENCL: no apache-tvm
wheel has that runtime (_tvm_runtime.py)."""
from __future__ import annotations

from ._tvm_runtime import needs, open_device

NAME = "opencl"
ORDER = 2
TARGETS = ("opencl",)
DLPACK = 4  # kDLOpenCL
DEFAULT_DTYPE = "float32"


def unavailable(target: str) -> str | None:
    return needs("opencl", "OpenCL", "USE_OPENCL")


def open(art_dir, manifest):  # noqa: A001 - the device interface's name
    return open_device("opencl", "OpenCL", "USE_OPENCL")
