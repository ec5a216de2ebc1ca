"""The CPU: artifacts of target cpu (this host's CPU family) and aarch64 (64-bit Arm Linux,
run on an arm64 machine; cross-compiled anywhere). GEMMs on numpy's BLAS (runtime/devices/cpu/blas.py)."""
from __future__ import annotations

import platform

from .blas import gemm  # noqa: F401 - the device interface's GEMM library

NAME = "cpu"
ORDER = 0
TARGETS = ("cpu", "aarch64")
DLPACK = 1  # kDLCPU
DEFAULT_DTYPE = "float32"  # numpy has no bf16 GEMM
ORT_PROVIDERS = ("CPUExecutionProvider",)
ORT_MEMORY = "cpu"

_ARM64 = ("aarch64", "arm64")


def unavailable(target: str) -> str | None:
    if target == "aarch64" and platform.machine().lower() not in _ARM64:
        return f"aarch64 artifacts run on a 64-bit Arm Linux machine, and this one is {platform.machine()}"
    return None


def open(art_dir, manifest):  # noqa: A001 - the device interface's name
    import tvm
    return tvm.cpu(0)


def memory_free() -> int | None:
    from ...limits import available_memory
    return available_memory()
