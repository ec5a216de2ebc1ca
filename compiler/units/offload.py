"""The activation-offload units on CUDA (graphs/ops/offload.py): copies to and from host memory.

    Offload(x1..xn) -> tokens     lorac.offload.<slot>(x1..xn, token)   out to pinned host memory
    Fetch(tokens) -> x1'..xn'     lorac.fetch.<slot>(token, x1..xn, y1'..ym')   back, before the recompute

The token is one [1] int32 tensor (every output of Offload is it). Each Offload call also takes
the values of the two slots offloaded before it, unread: the plan keeps a slot's storage until
two calls later, so the runtime copies it to the host straight from there, and the call that
lets it go first waits for that copy. Each Fetch call takes its slot's tensors, which the call
before it output (the plan holds them from there), and outputs the next slot's (y1'..ym'; the
top slot's call its own values first, the lowest slot's a token instead): the runtime copies
each slot from the host straight into them one fetch ahead, and a call only waits for its own;
the top slot's call and the lowest one's output their own values too, copied on the device
(manifest `fetch_ahead`). Each slot (a layer)
has functions of its own name, so the runtime knows the slot without a scalar argument (a
host-side function per call in TVM's VM). In bf16 builds the copies move activations in bf16
(how the step stores them: the residual stream, compiler/passes/residual_stream.py; GEMM
outputs; cuDNN's attention inputs and output) and the values the graph marks wide (attention's
row statistics) in fp32; Fetch's results are widened where the backward reads them, through the
attention units' narrowing cache, so cuDNN's backward reads the fetched bf16 values themselves.
The manifest's `unit_calls` lists each slot's tensors with shape and dtype: the runtime
allocates the pinned buffers and staging before a CUDA graph captures the step
(runtime/devices/cuda/offload.py).
"""
from __future__ import annotations

from tvm import relax

from lorac.core.constants import OFFLOAD_KEEP_ALIVE as KEEP_ALIVE

OFFLOAD, FETCH = "lorac.offload", "lorac.fetch"
TOKEN = relax.TensorType([1], "int32")


def _shape(x) -> list[int]:
    return [int(d) for d in x.ty.shape.values]


class _Cast:
    """Plain casts, where no narrowing cache is shared (fp32 builds move values as they are)."""

    def __call__(self, bb, x):
        return x if str(x.ty.dtype) == "bfloat16" else bb.emit(relax.op.astype(x, "bfloat16"))

    def widen(self, bb, x):
        return bb.emit(relax.op.astype(x, "float32"))


def converters(dtype: str, cache=None) -> dict:
    """Converter classes for the frontend; `calls` collects one entry per slot. `cache`: the
    attention units' narrowing cache (compiler/targets/cuda/attention.py) in bf16 builds."""
    from . import unit_converter

    calls: list = []
    narrow = dtype == "bfloat16"
    cache = cache if cache is not None else _Cast()
    slots: dict = {}  # slot -> [(shape, source dtype, moved dtype)]
    sent: list = []  # the moved values of each offload so far, in the step's order

    def offload(bb, inputs, attrs, _params):
        slot, wide = int(attrs["slot"]), int(attrs.get("wide", 0))
        moved, entries = [], []
        for i, x in enumerate(inputs):
            source = str(x.ty.dtype)
            if narrow and not wide >> i & 1 and source == "float32":
                x = cache(bb, x)
            moved.append(x)
            entries.append((_shape(x), source, str(x.ty.dtype)))
        slots[slot] = entries
        calls.append({"function": OFFLOAD, "slot": slot, "keep_alive": KEEP_ALIVE, "fetch_ahead": True,
                      "tensors": [{"shape": s, "dtype": d} for s, _, d in entries]})
        # the two slots before this one ride along unread: their values stay alive (the plan keeps
        # their memory) until the runtime has copied them out straight from where they are
        keep = [v for values in sent[-KEEP_ALIVE:] for v in values]
        sent.append(moved)
        token = bb.emit(relax.call_dps_packed(f"{OFFLOAD}.{slot}", moved + keep, TOKEN))
        return token if len(inputs) == 1 else relax.Tuple([token] * len(inputs))

    ahead: dict = {}  # slot -> its values' tensors, outputs of the fetch call before it

    def fetch(bb, inputs, attrs, _params):
        # fetched one call ahead: each call outputs the next slot's tensors (the plan allocates them
        # there) and the runtime copies that slot from the host straight into them, so the call that
        # takes them (this slot's) only waits. The first call (the top slot, whose values wait in
        # staging) and the last (which would output nothing another call reads, and so be dropped)
        # output their own values too: copies on the device, the top slot's from staging
        slot = int(attrs["slot"])
        entries = slots[slot]
        lower = [s for s in slots if s < slot]
        nxt = max(lower) if lower else None
        held = ahead.pop(slot, [])
        own = not held or nxt is None
        types = [relax.TensorType(s, d) for s, _, d in entries] if own else []
        types += [relax.TensorType(s, d) for s, _, d in slots[nxt]] if nxt is not None else []
        out = bb.emit(relax.call_dps_packed(f"{FETCH}.{slot}", [inputs[0], *held],
                                            types if len(types) > 1 else types[0]))
        items = [out] if len(types) == 1 else [bb.emit(relax.TupleGetItem(out, i)) for i in range(len(types))]
        values = items[:len(entries)] if own else held
        if nxt is not None:
            ahead[nxt] = items[len(entries):] if own else items
        values = [cache.widen(bb, v) if d != source else v for v, (_, source, d) in zip(values, entries)]
        return values[0] if len(values) == 1 else relax.Tuple(values)

    return {"Offload": unit_converter("Offload", offload, unit_calls=calls),
            "Fetch": unit_converter("Fetch", fetch, unit_calls=calls)}
