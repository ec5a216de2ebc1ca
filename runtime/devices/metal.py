"""Apple GPUs: artifacts of target metal. The macOS arm64 apache-tvm wheel carries the
Metal runtime (no other wheel does); TVM 0.27's Metal build crashes, so no metal artifact
exists yet (compiler/targets/metal.py)."""
from __future__ import annotations

from ._tvm_runtime import interface

NAME = "metal"
ORDER = 5
TARGETS = ("metal",)
DLPACK = 8  # kDLMetal
DEFAULT_DTYPE = "float32"
_WHEELS = "of the apache-tvm wheels only the macOS arm64 one has"

unavailable, open = interface("metal", "Metal", "USE_METAL", _WHEELS)  # noqa: A001 - the interface's names
