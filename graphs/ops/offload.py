"""Activation offload: a checkpointed layer's kept input waits in host memory.

With checkpointing, each recomputed layer keeps only its input x [N, D] from the forward to
its backward (compose.py); at a Llama-3-8B shape of 4x2048 that is 64 MB a layer in bf16,
2 GB for 32 layers. With TrainSpec.offload the forward hands x to an `Offload` unit and the
backward takes it back from a `Fetch` unit just before the layer's recompute:

    token = Offload(x)      slot = the layer's index
    x'    = Fetch(token)    the same values

Both bodies are Identity, so every ONNX runtime and the CPU build compute exactly what plain
checkpointing computes. On CUDA the compiler maps them to the runtime's copy functions
(compiler/units/offload.py, runtime/devices/cuda/offload.py): Offload's token is a tiny
tensor, so x's device memory is free as soon as it is copied out; the copies to and from
pinned host memory run on a side stream, overlapped with the layers' compute.
"""
from __future__ import annotations

OFFLOAD, FETCH = "Offload", "Fetch"


def _identity(fb, x):
    return fb.op("Identity", x)


def offload(g, x, slot: int):
    """Hand x (a layer's kept input) to host memory; -> the token Fetch takes."""
    return g.call(OFFLOAD, g.np_float.name, [x], 1, _identity, slot=slot)


def fetch(g, token, slot: int):
    """x again, from the token Offload gave for the same slot."""
    return g.call(FETCH, g.np_float.name, [token], 1, _identity, slot=slot)
