"""Apple GPUs: artifacts of target metal. The macOS arm64 apache-tvm wheel carries the
Metal runtime (no other wheel does); TVM 0.27's Metal build crashes, so no metal artifact
exists yet (compiler/target_metal.py)."""
from __future__ import annotations

from ._tvm_runtime import needs, open_device

NAME = "metal"
ORDER = 5
TARGETS = ("metal",)
DLPACK = 8  # kDLMetal
DEFAULT_DTYPE = "float32"
_WHEELS = "of the apache-tvm wheels only the macOS arm64 one has"


def unavailable(target: str) -> str | None:
    return needs("metal", "Metal", "USE_METAL", _WHEELS)


def open(art_dir, manifest):  # noqa: A001 - the device interface's name
    return open_device("metal", "Metal", "USE_METAL", _WHEELS)
