"""Names more than one stage spells: one definition each."""

# Compiler target families in listing order (help texts, docs, `lorac compile --target`).
# The compiler finds its families from its target_<family>.py files and sorts them by this;
# the runtime's devices (runtime/devices/) list the same families in the same order
# (tests/test_layers.py checks both against it). A new family not listed here sorts last.
TARGET_ORDER = ("cpu", "aarch64", "cuda", "opencl", "rocm", "vulkan", "metal", "webgpu")

# The folder the runtime keeps compiled artifacts in, relative to the working directory.
CACHE_DIR = ".lorac-cache"

# PEFT's names of the two LoRA matrices, as they appear in every tensor name.
LORA_A, LORA_B = "lora_A", "lora_B"

# Isolated packing on CUDA runs lorac's own attention kernels where Triton is installed on the
# compiling machine (compiler/targets/cuda/packed_kernels.py: no bias, no extra memory), for rows
# of at most PACKED_KERNEL_MAX_SEQ tokens. Without them
# cuDNN masks documents with an additive bias [B, 1, S, S] bf16 for rows of at most
# PACKED_BIAS_MAX_SEQ tokens while it takes at most PACKED_BIAS_MAX_BYTES, and with its ragged
# layout otherwise: on an H100 the ragged call is 1.5-1.8x the plain one at 1024 tokens (the bias
# 1.3x) but 0.65-0.94x at 2048-8192 (the bias 1.6-2.2x; docs/BENCHMARKS.md)
# (compiler/targets/cuda/attention.py; the memory estimate counts the bias: runtime/train/memory.py).
PACKED_BIAS_MAX_BYTES = 256 << 20
PACKED_BIAS_MAX_SEQ = 1024
# lorac's kernels take rows of up to this many tokens. Longer rows go to cuDNN's ragged layout: at
# 1x8192 with documents of up to 5217 tokens the kernels took 1.04x the plain call and ragged 0.64x
# (its kernels do a long document's tiles over twice as fast), while at 2x4096 they tie (0.64x,
# 0.63x) and at 4x2048 the kernels win (0.67x, 0.93x; an H100, docs/BENCHMARKS.md)
PACKED_KERNEL_MAX_SEQ = 4096
# ... and head sizes (Triton's dots take powers of two from 16; 256 does not fit the shared memory of
# the kernels' block configurations): other sizes, Phi-3's 96 and Gemma 2's 256, stay on cuDNN
PACKED_KERNEL_HEAD_DIMS = (16, 32, 64, 128)


def packed_kernels_available() -> bool:
    """Whether a CUDA build here can mask packed documents with lorac's kernels (Triton importable)."""
    import importlib.util
    return importlib.util.find_spec("triton") is not None


def packed_kernels_take(seq: int, head_dim: int) -> bool:
    """Whether a CUDA build here runs packed rows of `seq` tokens, heads of `head_dim`, on lorac's kernels."""
    return seq <= PACKED_KERNEL_MAX_SEQ and head_dim in PACKED_KERNEL_HEAD_DIMS and packed_kernels_available()


def packed_bias_bytes(batch: int, seq: int, max_bytes: int = PACKED_BIAS_MAX_BYTES,
                      max_seq: int = PACKED_BIAS_MAX_SEQ) -> int:
    """Bytes of cuDNN's document bias of [batch, seq] packed rows, 0 where the ragged layout is used."""
    n = 2 * batch * seq * seq
    return n if n <= max_bytes and seq <= max_seq else 0

# A LoRA projection over a dequantized weight whose output is at least this many times wider
# than its input runs as one GEMM over [x | u] and [W | B] in bf16 CUDA steps
# (compiler/passes/gemm_lora_k.py); the memory estimate counts the wider rows (runtime/train/memory.py).
LORA_K_WIDE = 2
# ... and the adapted projections of one input (q/k/v) join together where their outputs together are at
# least as wide as it, which lets a bf16 base hold them joined too. Off: measured on an H100 (Llama-3-8B
# 4x2048, 20 GB) its numerics pass but it saves 0.6 ms of a 601 ms step for 0.2 GB more (docs/BENCHMARKS.md)
LORA_K_GROUPS = False

# Each activation-offload call holds the values of this many slots offloaded before it, so the CUDA
# runtime copies a slot to the host straight from the step's memory and the call that lets it go
# waits for that copy (compiler/units/offload.py; runtime/devices/cuda/offload.py, whose two
# staging buffers and two-slots-ago wait are built for this count).
OFFLOAD_KEEP_ALIVE = 2
