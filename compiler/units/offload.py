"""The activation-offload units on CUDA (graphs/ops/offload.py): copies to and from host memory.

    Offload(x) -> token       lorac.offload.<slot>(x, token)    x [N, D] out to pinned host memory
    Fetch(token) -> x'        lorac.fetch.<slot>(token, x')     back, just before the recompute

The token is a [1] int32 tensor: once Offload has run, nothing reads x, so the memory plan
reuses its storage at once. Each slot (a layer) has functions of its own name, so the runtime
knows the slot without a scalar argument (a host-side function per call in TVM's VM). In bf16
builds the copies move x in bf16 (the residual stream is stored so: compiler/passes/
residual_stream.py) and Fetch's result is widened where the recompute reads it. The manifest's
`unit_calls` lists each slot with its shape and dtype: the runtime allocates the pinned buffers
and staging before a CUDA graph captures the step (runtime/devices/cuda/offload.py).
"""
from __future__ import annotations

from tvm import relax

OFFLOAD, FETCH = "lorac.offload", "lorac.fetch"
TOKEN = relax.TensorType([1], "int32")


def _shape(x) -> list[int]:
    return [int(d) for d in x.ty.shape.values]


def converters(dtype: str) -> dict:
    """Converter classes for the frontend; `calls` collects one entry per slot."""
    from . import unit_converter

    calls: list = []
    moved = "bfloat16" if dtype == "bfloat16" else "float32"
    shapes: dict = {}  # slot -> (shape, source dtype)

    def offload(bb, inputs, attrs, _params):
        x, slot = inputs[0], int(attrs["slot"])
        shape = _shape(x)
        shapes[slot] = (shape, str(x.ty.dtype))
        calls.append({"function": OFFLOAD, "slot": slot, "shape": shape, "dtype": moved})
        if str(x.ty.dtype) != moved:
            x = bb.emit(relax.op.astype(x, moved))
        return bb.emit(relax.call_dps_packed(f"{OFFLOAD}.{slot}", [x], TOKEN))

    def fetch(bb, inputs, attrs, _params):
        slot = int(attrs["slot"])
        shape, source = shapes[slot]
        x = bb.emit(relax.call_dps_packed(f"{FETCH}.{slot}", [inputs[0]], relax.TensorType(shape, moved)))
        return bb.emit(relax.op.astype(x, source)) if source != moved else x

    return {"Offload": unit_converter("Offload", offload, unit_calls=calls),
            "Fetch": unit_converter("Fetch", fetch, unit_calls=calls)}
