"""Sizes checked against the model and the machine before anything is compiled.

A sequence longer than the model's context, a rank wider than every adapted projection, or
a step whose memory cannot fit is refused with one line: compiling such a graph only fills
memory until the OOM killer ends it (`--seq 100000` on a 512-context model grew the compile
past 21 GB; the causal mask alone is seq x seq).

The memory estimate is a lower bound, so it never refuses a step that fits: the device copy
of the frozen weights, the LoRA tensors with their gradient and AdamW moments, and buffers
any such step holds at some moment (one layer's attention probabilities, one loss chunk of
logits, each layer's input kept for the backward). It is checked against this machine's
memory for the CPU and against the GPU's free memory for CUDA where a GPU is visible (a
compile-only machine has none to compare with).
"""
from __future__ import annotations

import os

from .errors import LoracError


def context_length(config: dict) -> int | None:
    """The model's context length (HF max_position_embeddings; GGUF context_length maps there)."""
    n = config.get("max_position_embeddings")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


def check_context(seq: int, config: dict, flag: str) -> None:
    from lorac.graphs.families import for_model_type, model_types
    n = context_length(config)
    known = config.get("model_type") in model_types()
    bounded = not known or for_model_type(config["model_type"]).CONTEXT_LIMITED
    if n is not None and bounded and seq > n:
        raise LoracError(f"{flag} {seq} exceeds the model's context length {n} (max_position_embeddings)")


def check_rank(spec, train, flag: str = "--rank") -> None:
    widest = max(min(spec.proj_shape(t)) for t in train.lora_targets)
    if train.rank > widest:
        raise LoracError(f"{flag} {train.rank} exceeds the width of every adapted projection (at most {widest}): "
                         f"a rank-r LoRA of an [out, in] matrix needs r <= min(out, in)")


def lora_params(spec, train) -> int:
    """How many LoRA parameters a run trains: rank x (in + out) per adapted projection and layer."""
    return sum(train.rank * sum(spec.proj_shape(t)) for t in train.lora_targets) * len(train.layers(spec))


def step_bytes_lower_bound(spec, train, n_weights: int, itemsize: int = 4, target: str = "cpu",
                           packed_bytes: int = 0) -> int:
    """A lower bound on the bytes one training step needs (module doc). On CUDA the frozen
    weights are bf16 and attention is cuDNN's fused kernel (no [S, S] probabilities), except
    for packed documents (--packing isolated), whose attention is inlined (bf16 scores).
    `n_weights` dense frozen elements; `packed_bytes` of quantized blocks (train/memory.frozen_sizes)."""
    b, s, layers = train.batch, train.seq, len(train.layers(spec))
    lora = lora_params(spec, train)
    attention = b * spec.heads * s * s if hasattr(spec, "heads") else 0  # Mamba has none
    if target == "cuda":
        attention = attention // 2 if getattr(train, "packing", "plain") == "isolated" else 0
    weights = n_weights // 2 if target == "cuda" else n_weights
    chunk = min(train.loss_chunk or b * s, b * s)
    return packed_bytes + itemsize * (weights + 4 * lora + attention + chunk * spec.vocab + layers * b * s * spec.hidden)


def available_memory() -> int | None:
    """Bytes of memory available to a new allocation (Linux MemAvailable, else physical), or None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def gpu_memory_info() -> tuple[int, int] | None:
    """(free, total) bytes on the current CUDA device (cudaMemGetInfo), or None without a usable GPU."""
    import ctypes
    try:
        from .devices.cuda.cublas import load_library
        cudart = load_library("libcudart")
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        if cudart.cudaMemGetInfo(ctypes.byref(free), ctypes.byref(total)) != 0:
            return None
        return free.value, total.value
    except (LoracError, OSError, AttributeError):
        return None


def gpu_memory_free() -> int | None:
    """Free bytes on the current CUDA device, or None without a usable GPU."""
    info = gpu_memory_info()
    return info and info[0]


def check_plan(manifest: dict, device, what: str) -> None:
    """Once a graph is compiled, before its first call allocates it: its static memory plan
    (manifest `memory.static_plan_bytes`, what TVM allocates for activations and workspace)
    against what the device has free now (the weights are loaded already). The lower bound of
    check_memory is far below a real plan (a 100000 x 32 step: 4 GiB bound, 27.7 GB planned),
    and past it TVM's allocation failed with a bare `std::bad_alloc`."""
    plan = (manifest.get("memory") or {}).get("static_plan_bytes")
    have = getattr(device, "memory_free", lambda: None)()
    if isinstance(plan, int) and have is not None and plan > have:
        where = "the GPU" if getattr(device, "NAME", "") == "cuda" else "this machine"
        raise LoracError(f"the compiled {what} graph needs {plan / 2**30:.1f} GiB for its activations and workspace, "
                         f"{where} has {have / 2**30:.1f} GiB available; lower --batch or --seq (or use "
                         "--checkpointing / --loss-chunk)")


def check_memory(spec, train, n_weights: int, target: str, packed_bytes: int = 0) -> None:
    """Refuse a step whose lower-bound memory exceeds what the machine (cpu) or the GPU
    (cuda, when one is visible) has available."""
    from . import devices
    have = getattr(devices.for_target(target), "memory_free", lambda: None)()
    need = step_bytes_lower_bound(spec, train, n_weights, target=target, packed_bytes=packed_bytes)
    if have is not None and need > have:
        raise LoracError(f"a training step of batch {train.batch} x seq {train.seq} at rank {train.rank} needs at least "
                         f"{need / 2**30:.1f} GiB, {'the GPU' if target == 'cuda' else 'this machine'} has {have / 2**30:.1f} GiB available; lower --batch, "
                         "--seq or --rank (or use --checkpointing / --loss-chunk)")
