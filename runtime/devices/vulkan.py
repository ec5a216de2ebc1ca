"""Vulkan GPUs: artifacts of target vulkan (SPIR-V kernels), where the compiling TVM has
Vulkan codegen (the apache-tvm 0.27 wheel has not). Runs only in a TVM built with
USE_VULKAN: no apache-tvm wheel has that runtime (_tvm_runtime.py)."""
from __future__ import annotations

from ._tvm_runtime import interface

NAME = "vulkan"
ORDER = 4
TARGETS = ("vulkan",)
DLPACK = 7  # kDLVulkan
DEFAULT_DTYPE = "float32"

unavailable, open = interface("vulkan", "Vulkan", "USE_VULKAN")  # noqa: A001 - the interface's names
