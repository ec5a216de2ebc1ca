"""WebGPU: artifacts of target webgpu (lib.tar: wasm32 objects and WGSL kernels) run in a
browser or wgpu through TVM's web runtime (tvmjs, emscripten), not in Python."""
from __future__ import annotations

NAME = "webgpu"
ORDER = 6
TARGETS = ("webgpu",)
DLPACK = 15  # kDLWebGPU
DEFAULT_DTYPE = "float32"

_WHY = ("its artifacts (wasm32 objects + WGSL) run in a browser or wgpu through TVM's web runtime (tvmjs), "
        "not in lorac's Python runtime")


def unavailable(target: str) -> str | None:
    return _WHY


def open(art_dir, manifest):  # noqa: A001 - the device interface's name
    from ..errors import LoracError
    raise LoracError(f"device webgpu: {_WHY}")
