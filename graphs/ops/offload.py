"""Activation offload: a checkpointed layer's kept values wait in host memory.

With checkpointing, each recomputed layer keeps only its input x [N, D] from the forward to
its backward (compose.py); at a Llama-3-8B shape of 4x2048 that is 64 MB a layer in bf16,
2 GB for 32 layers. With TrainSpec.offload the forward hands x to an `Offload` unit and the
backward takes it back from a `Fetch` unit just before the layer's recompute:

    t1, ..., tn = Offload(x1, ..., xn)      slot = the layer's index
    x1', ..., xn' = Fetch(t1, ..., tn)      the same values

With TrainSpec.offload_state the slot holds the layer's attention state as well (its q, k, v,
attention output and row statistics: decoder.attention_state), sent once the layer's forward
has computed them, and the backward recomputes only the MLP half (decoder.layer_refill). A
graph's slots all move the same number of values (one variant of each unit a graph).

Both bodies are Identity, so every ONNX runtime and the CPU build compute exactly what plain
checkpointing computes. On CUDA the compiler maps them to the runtime's copy functions
(compiler/units/offload.py, runtime/devices/cuda/offload.py): Offload's results are one tiny
token, so the values' device memory is free as soon as they are copied out; the copies to and
from pinned host memory run on a side stream, overlapped with the layers' compute.
"""
from __future__ import annotations

OFFLOAD, FETCH = "Offload", "Fetch"


def _identity(fb, *xs):
    return [fb.op("Identity", x) for x in xs]


def offload(g, xs: list, slot: int, wide: tuple = ()) -> list:
    """Hand the values `xs` of one slot (a layer) to host memory; -> the tokens Fetch takes.
    `wide`: indices of values a bf16 build moves in fp32 (statistics); the others move in the
    build's activation dtype, which is how the compiled step stores them anyway."""
    return _call(g, OFFLOAD, xs, slot, sum(1 << i for i in wide))


def fetch(g, tokens: list, slot: int) -> list:
    """The values again, from the tokens Offload gave for the same slot."""
    return _call(g, FETCH, tokens, slot, 0)


def _call(g, name: str, xs: list, slot: int, wide: int) -> list:
    out = g.call(name, f"{g.np_float.name} n={len(xs)}", list(xs), len(xs), _identity, slot=slot, wide=wide)
    return list(out) if len(xs) > 1 else [out]
