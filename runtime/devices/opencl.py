"""OpenCL GPUs: artifacts of target opencl (TVM's own kernels, OpenCL C compiled by the
driver when the library loads). Runs only in a TVM built with USE_OPENCL: no apache-tvm
wheel has that runtime (_tvm_runtime.py)."""
from __future__ import annotations

from ._tvm_runtime import interface

NAME = "opencl"
ORDER = 2
TARGETS = ("opencl",)
DLPACK = 4  # kDLOpenCL
DEFAULT_DTYPE = "float32"

unavailable, open = interface("opencl", "OpenCL", "USE_OPENCL")  # noqa: A001 - the interface's names
