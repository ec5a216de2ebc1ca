"""WebGPU, two ways:
- `lorac train --target webgpu` trains on the GPU through onnxruntime's WebGPU plugin
  (`--backend ort`, engine/ort_webgpu.py; pip install 'lorac[webgpu]'; Dawn on Vulkan, Metal
  or D3D12), the buffers resident on its device (ORT_MEMORY);
- TVM's artifacts of target webgpu (`--compile-only`; lib.tar: wasm32 objects and WGSL
  kernels) run in a browser or wgpu through TVM's web runtime (tvmjs, emscripten), not in
  Python."""
from __future__ import annotations

NAME = "webgpu"
ORDER = 6
TARGETS = ("webgpu",)
DLPACK = 15  # kDLWebGPU
DEFAULT_DTYPE = "float32"
ORT_PROVIDERS = ("WebGpuExecutionProvider", "CPUExecutionProvider")  # the plugin, the CPU as its fallback
ORT_MEMORY = "webgpu"
TRAINS_ON = "ort"  # TVM's webgpu artifacts run in browsers: `lorac train` goes through the plugin
# default --loss-chunk: a chunk's fp32 logits <= 512 MiB, within what WebGPU adapters let one
# storage buffer binding hold (the spec's default limit is 128 MiB; GPUs raise it, to 4 GiB at most)
LOSS_CHUNK_BYTES = 1 << 29

_WHY = ("its artifacts (wasm32 objects + WGSL) run in a browser or wgpu through TVM's web runtime (tvmjs), "
        "not in lorac's Python runtime")


def unavailable(target: str) -> str | None:
    return _WHY


def open(art_dir, manifest):  # noqa: A001 - the device interface's name
    from ..errors import LoracError
    raise LoracError(f"device webgpu: {_WHY}; `lorac train --target webgpu` trains through onnxruntime's WebGPU "
                     "plugin instead")


def check_ort() -> None:
    """The WebGPU plugin and an adapter, or one LoracError line (runtime/engine/ort_webgpu.py)."""
    from ..engine.ort_webgpu import check
    check()
