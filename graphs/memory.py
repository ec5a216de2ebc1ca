"""Peak live activation bytes of a graph executed in node order (what checkpointing trades).

A value is live from the node that makes it until its last reader (graph outputs: until
the end). Graph inputs and initializers are not counted: they are the same with or without
checkpointing. This is the number an in-order executor with a perfect allocator needs.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper


def peak_live_bytes(model: onnx.ModelProto) -> int:
    g = model.graph
    sizes = {}
    for vi in list(g.value_info) + list(g.output):
        t = vi.type.tensor_type
        n = int(np.prod([d.dim_value for d in t.shape.dim])) if t.shape.dim else 1
        sizes[vi.name] = n * np.dtype(helper.tensor_dtype_to_np_dtype(t.elem_type)).itemsize
    last = {}
    for i, node in enumerate(g.node):
        for name in node.input:
            last[name] = i
    end = len(g.node)
    for o in g.output:
        last[o.name] = end
    live = peak = 0
    dying: dict[int, list[str]] = {}
    for i, node in enumerate(g.node):
        for name in node.output:
            live += sizes.get(name, 0)
            dying.setdefault(last.get(name, i), []).append(name)
        peak = max(peak, live)
        for name in dying.pop(i, []):
            live -= sizes.get(name, 0)
    return peak
