"""The CPU: artifacts of target cpu (this host's CPU family) and aarch64 (64-bit Arm Linux,
run on an arm64 machine; cross-compiled anywhere). GEMMs on numpy's OpenBLAS or Intel MKL, whichever
is faster per shape on this machine (runtime/devices/cpu/blas.py)."""
from __future__ import annotations

import builtins
import os
import platform
from pathlib import Path

from .blas import gemm  # noqa: F401 - the device interface's GEMM library

NAME = "cpu"
ORDER = 0
TARGETS = ("cpu", "aarch64")
DLPACK = 1  # kDLCPU
DEFAULT_DTYPE = "float32"  # numpy has no bf16 GEMM
ORT_PROVIDERS = ("CPUExecutionProvider",)
ORT_MEMORY = "cpu"
MEMORY_OF = "this machine"
TUNED_TARGETS = ("cpu",)  # aarch64 is cross-compiled: nothing here can measure its kernels
# --quantized-base auto: a quantized base is dequantized on load, the faster step here (the
# SmolLM2 Q4_K_M step kept took 1.1-1.75x the dense one's wall time on two threads for 17 %
# less peak memory: docs/BENCHMARKS.md, QLoRA on the CPU), unless the dense weights alone would take
# more than half of the free memory: then only the blocks fit with the step's activations
KEEPS_QUANTIZED_ABOVE = 0.5
# AUTO_CHECKPOINTING, LOSS_CHUNK_BYTES, FUSED_ATTENTION: the defaults (off, one chunk, none):
# memory is plentiful and the attention is TVM's, so isolated packing costs what plain does

_ARM64 = ("aarch64", "arm64")


def unavailable(target: str) -> str | None:
    if target == "aarch64" and platform.machine().lower() not in _ARM64:
        return f"aarch64 artifacts run on a 64-bit Arm Linux machine, and this one is {platform.machine()}"
    return None


def open(art_dir, manifest):  # noqa: A001 - the device interface's name
    import tvm

    from . import blas
    # the GEMM choices of this machine, kept beside the artifacts (as the tuning database)
    blas.use_cache_dir(Path(art_dir).parent / ".lorac-tuning")
    return tvm.cpu(0)


def gemm_info() -> str:
    from .blas import blas_info
    return blas_info()


def memory_free() -> int | None:
    """Bytes of memory available to a new allocation (Linux MemAvailable, else physical), or None."""
    try:
        with builtins.open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
