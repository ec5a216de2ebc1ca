"""AMD GPUs: artifacts of target rocm (TVM's own kernels; hipBLAS not wired). Runs only in
a TVM built with USE_ROCM: no apache-tvm wheel has that runtime (_tvm_runtime.py)."""
from __future__ import annotations

from ._tvm_runtime import needs, open_device

NAME = "rocm"
ORDER = 3
TARGETS = ("rocm",)
DLPACK = 10  # kDLROCM
DEFAULT_DTYPE = "float32"


def unavailable(target: str) -> str | None:
    return needs("rocm", "ROCm", "USE_ROCM")


def open(art_dir, manifest):  # noqa: A001 - the device interface's name
    return open_device("rocm", "ROCm", "USE_ROCM")
