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
