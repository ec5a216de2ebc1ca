"""AMD GPUs: artifacts of target rocm (TVM's own kernels; hipBLAS not wired). Runs only in
a TVM built with USE_ROCM: no apache-tvm wheel has that runtime (_tvm_runtime.py)."""
from __future__ import annotations

from ._tvm_runtime import interface

NAME = "rocm"
ORDER = 3
TARGETS = ("rocm",)
DLPACK = 10  # kDLROCM
DEFAULT_DTYPE = "float32"

unavailable, open = interface("rocm", "ROCm", "USE_ROCM")  # noqa: A001 - the interface's names
