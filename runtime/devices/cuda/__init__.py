"""NVIDIA GPUs: artifacts of target cuda. Kernels compiled ahead into the artifact's fatbin
(runtime/devices/cuda/loader.py: no NVRTC or nvcc on the GPU machine), GEMMs on cuBLAS (runtime/devices/cuda/cublas.py),
bf16 attention on cuDNN's fused SDPA, packed documents in its ragged layout
(runtime/devices/cuda/attention.py), the training step as CUDA
graphs (compiler/targets/cuda binds_inputs), offloaded checkpoints in pinned host memory
(runtime/devices/cuda/offload.py), an embedding table the lookup reads from host memory (mapped.py)."""
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
MEMORY_OF = "the GPU"
TUNED_TARGETS = ("cuda",)  # MetaSchedule measures on this machine's GPU (needs nvcc)
AUTO_CHECKPOINTING = True  # GPU memory is what bounds a step: fit it (runtime/train/memory.py)
LOSS_CHUNK_BYTES = 3 << 29  # 1.5 GiB of fp32 logits a chunk bounds the [tokens, vocab] logits
FUSED_ATTENTION = True  # bf16 attention runs on cuDNN's fused SDPA (attention.py)
# rows packed in isolation too: each document a sequence of cuDNN's ragged layout (attention.py)
ISOLATED_PACKING_FAST = True
DEVICE_PER_WORKER = True  # a data-parallel worker per GPU of the host
GRAD_ALLREDUCE = "nccl"  # gradients summed on the GPUs (runtime/dist/nccl.py)
WORKER_DEVICE = "LORAC_CUDA_DEVICE"  # the GPU a process opens artifacts on (select)


def host_pinnable() -> int | None:
    """Host bytes offloaded values may pin (offload.py: a share of the host's available memory)."""
    from .offload import pinnable
    return pinnable()


def host_table(shape, dtype: str):
    """A CUDA tensor over pinned, mapped host memory and a numpy view to fill it (mapped.py)."""
    import os

    from .mapped import host_table as table
    return table(shape, dtype, int(os.environ.get(WORKER_DEVICE, "0")))


def unavailable(target: str) -> str | None:
    return None  # a missing GPU is found when the first artifact loads (a compile-only box has none)


def open(art_dir, manifest):  # noqa: A001 - the device interface's name
    from . import loader as cuda_loader
    from ...errors import LoracError
    cuda_loader.prepare(art_dir, manifest)
    import os

    import tvm
    dev = tvm.cuda(int(os.environ.get(WORKER_DEVICE, "0")))  # a data-parallel worker's GPU (select)
    if not dev.exist:
        raise LoracError("device cuda requested but no CUDA GPU is visible")
    calls = {c.get("function") for c in manifest.unit_calls}
    from . import attention as attention_cuda
    from . import offload
    if calls & set(attention_cuda.FUNCTIONS):  # fused attention on cuDNN: plans built now
        attention_cuda.prepare(manifest, dev, art_dir)
    if offload.OFFLOAD in calls:  # offloaded checkpoints: pinned buffers and staging made now
        offload.prepare(manifest)
    return dev


def feeder(manifest):
    """What a Step calls with each call's inputs before running the artifact: the packed
    attention's document lengths and offsets from position_ids (attention.py), or None."""
    from . import attention as attention_cuda
    return attention_cuda.feeder(manifest)


def reserve_documents(per_row: int, longest: int | None = None) -> None:
    """The most documents a row of the run's data holds and its longest document: the packed
    attention's cuDNN plans are built for that many sequences a row, of at most that many
    tokens (attention.py)."""
    from . import attention as attention_cuda
    attention_cuda.reserve_documents(per_row, longest)


def select(index: int) -> None:
    """Open artifacts on GPU `index` of this host. All GPUs stay visible (NCCL finds NVLink
    only between GPUs a process can see)."""
    import os
    os.environ[WORKER_DEVICE] = str(index)


def memory_info() -> tuple[int, int] | None:
    """(free, total) bytes on the current CUDA device (cudaMemGetInfo), or None without a usable GPU."""
    import ctypes

    from ...errors import LoracError
    try:
        from .cudart import runtime
        cudart = runtime()
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        if cudart.cudaMemGetInfo(ctypes.byref(free), ctypes.byref(total)) != 0:
            return None
        return free.value, total.value
    except (LoracError, OSError, AttributeError):
        return None


def memory_free() -> int | None:
    """Free bytes on the current CUDA device, or None without a usable GPU (a compile-only box)."""
    info = memory_info()
    return info and info[0]
