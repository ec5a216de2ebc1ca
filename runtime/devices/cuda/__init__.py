"""NVIDIA GPUs: artifacts of target cuda. Kernels compiled ahead into the artifact's fatbin
(runtime/devices/cuda/loader.py: no NVRTC or nvcc on the GPU machine), GEMMs on cuBLAS (runtime/devices/cuda/cublas.py),
bf16 attention on cuDNN's fused SDPA (runtime/devices/cuda/attention.py), the training step as CUDA
graphs (compiler/targets/cuda binds_inputs), offloaded checkpoints in pinned host memory
(runtime/devices/cuda/offload.py)."""
from __future__ import annotations

from .cublas import gemm  # noqa: F401 - the device interface's GEMM library

NAME = "cuda"
ORDER = 1
TARGETS = ("cuda",)
DLPACK = 2  # kDLCUDA
DEFAULT_DTYPE = "bfloat16"
CAPTURES_GRAPHS = True
# a quantized base stays in its blocks (QLoRA): the GPU is where its memory matters
KEEPS_QUANTIZED = True
# --checkpointing offload: checkpointed inputs in pinned host memory (offload.py)
OFFLOADS = True
ORT_PROVIDERS = ("CUDAExecutionProvider", "CPUExecutionProvider")
ORT_MEMORY = "cuda"
LOSS_CHUNK_BYTES = 3 << 29  # default --loss-chunk: a chunk's fp32 logits <= 1.5 GiB (graphs/loss.auto_chunk)


def unavailable(target: str) -> str | None:
    return None  # a missing GPU is found when the first artifact loads (a compile-only box has none)


def open(art_dir, manifest):  # noqa: A001 - the device interface's name
    from . import loader as cuda_loader
    from ...errors import LoracError
    cuda_loader.prepare(art_dir, manifest)
    import os

    import tvm
    dev = tvm.cuda(int(os.environ.get("LORAC_CUDA_DEVICE", "0")))  # a data-parallel worker's GPU
    if not dev.exist:
        raise LoracError("device cuda requested but no CUDA GPU is visible")
    calls = {c.get("function") for c in manifest.get("unit_calls", [])}
    from . import attention as attention_cuda, offload
    if calls & {attention_cuda.FWD, attention_cuda.BWD}:  # fused attention on cuDNN: plans built now
        attention_cuda.prepare(manifest, dev)
    if offload.OFFLOAD in calls:  # offloaded checkpoints: pinned buffers and staging made now
        offload.prepare(manifest)
    return dev


def memory_free() -> int | None:
    from ...limits import gpu_memory_free
    return gpu_memory_free()
