"""Sizes checked against the model and the machine before anything is compiled.

A sequence longer than the model's context, a rank wider than every adapted projection, or
a step whose memory cannot fit is refused with one line: compiling such a graph only fills
memory until the OOM killer ends it (`--seq 100000` on a 512-context model grew the compile
past 21 GB; the causal mask alone is seq x seq).

The memory estimate is a lower bound, so it never refuses a step that fits: the device copy
of the frozen weights, the LoRA tensors with their gradient and AdamW moments, and buffers
any such step holds at some moment (one layer's attention probabilities, one loss chunk of
logits, each layer's input kept for the backward). It is checked against what the device
says is free (runtime/devices/: `memory_free`, this machine's memory for the CPU, the GPU's
free memory for CUDA where a GPU is visible; a compile-only machine has none to compare with).
"""
from __future__ import annotations

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


def frozen_bytes(n_weights: int, device, packed_bytes: int = 0) -> int:
    """Bytes of the frozen weights on `device`: `n_weights` dense elements in its default dtype
    (bf16 on CUDA) and `packed_bytes` of quantized blocks (train/memory.frozen_sizes)."""
    from lorac.core.dtypes import as_dtype
    return n_weights * as_dtype(device.DEFAULT_DTYPE).itemsize + packed_bytes


def step_bytes_lower_bound(spec, train, n_weights: int, device, itemsize: int = 4, packed_bytes: int = 0) -> int:
    """A lower bound on the bytes one training step needs on `device` (module doc): the frozen
    weights (frozen_bytes) and, in `itemsize` bytes each, the LoRA state, the attention
    probabilities where attention is not a fused kernel (cuDNN, packed documents too hold no
    [S, S] ones), a loss chunk's logits and each layer's input."""
    b, s, layers = train.batch, train.seq, len(train.layers(spec))
    lora = lora_params(spec, train)
    attention = b * spec.heads * s * s if hasattr(spec, "heads") else 0  # Mamba has none
    if device.FUSED_ATTENTION:
        attention = 0
    chunk = min(train.loss_chunk or b * s, b * s)
    return frozen_bytes(n_weights, device, packed_bytes) + itemsize * (
        4 * lora + attention + chunk * spec.vocab + layers * b * s * spec.hidden)


def check_plan(manifest, device, what: str) -> None:
    """Once a graph is compiled, before its first call allocates it: its static memory plan
    (the manifest's `memory.static_plan_bytes`, what TVM allocates for activations and
    workspace) against what the device has free now (the weights are loaded already). The
    lower bound of check_memory is far below a real plan (a 100000 x 32 step: 4 GiB bound,
    27.7 GB planned), and past it TVM's allocation failed with a bare `std::bad_alloc`."""
    plan = manifest.memory.get("static_plan_bytes")
    have = device.memory_free()
    if isinstance(plan, int) and have is not None and plan > have:
        raise LoracError(f"the compiled {what} graph needs {plan / 2**30:.1f} GiB for its activations and workspace, "
                         f"{device.MEMORY_OF} has {have / 2**30:.1f} GiB available; lower --batch or --seq (or use "
                         "--checkpointing / --loss-chunk)")


# what a dense base that does not fit is told, where the device keeps a quantized base (QLoRA)
QUANTIZE_HINT = "--quantize nf4 (or int8) keeps the linear weights in 4-bit (8-bit) blocks (QLoRA)"


def check_memory(spec, train, n_weights: int, device, packed_bytes: int = 0) -> None:
    """Refuse a step whose lower-bound memory exceeds what `device` says is available (this
    machine's for the CPU, the GPU's when one is visible). Where the frozen weights alone do
    not fit, smaller batches cannot help: the message says so, and on a device that keeps a
    quantized base (QLoRA) how to quantize it."""
    have = device.memory_free()
    need = step_bytes_lower_bound(spec, train, n_weights, device, packed_bytes=packed_bytes)
    if have is None or need <= have:
        return
    weights = frozen_bytes(n_weights, device, packed_bytes)
    if weights > have:
        hint = "use a smaller model or a device with more memory"
        if device.KEEPS_QUANTIZED and not packed_bytes:
            hint = QUANTIZE_HINT
        elif device.KEEPS_QUANTIZED and n_weights:
            hint = "--quantize-embeddings nf4 holds the embedding tables in 4-bit blocks too"
        raise LoracError(f"the frozen weights alone take {weights / 2**30:.1f} GiB and {device.MEMORY_OF} has "
                         f"{have / 2**30:.1f} GiB available: {hint}")
    raise LoracError(f"a training step of batch {train.batch} x seq {train.seq} at rank {train.rank} needs at least "
                     f"{need / 2**30:.1f} GiB, {device.MEMORY_OF} has {have / 2**30:.1f} GiB available; lower "
                     "--batch, --seq or --rank (or use --checkpointing / --loss-chunk)")
