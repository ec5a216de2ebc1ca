"""A graph's LoRA tensors as the optimizer's flat buckets: one input and one gradient per bucket.

    model = flat_lora_io(build_training_graph(spec, train), shapes)

The optimizer keeps each bucket's parameters as one flat vector (optimizer.Bucket). A graph
that takes the LoRA tensors one by one makes the runtime copy every tensor into and out of
those vectors each step: for Qwen3-0.6B with all seven targets, 392 parameter copies in
and 392 gradient copies out, ~10 ms of host work a step, which the GPU then waits for at
small batches. Rewritten here, the graph takes `<bucket>.param` [size] and slices each
tensor out of it (the slice fuses into the kernel that reads the tensor), and writes
`<bucket>.grad` [size], the bucket's gradients concatenated in the bucket's order; the
per-tensor `<name>.grad` outputs go. The math is unchanged, value for value.

Each gradient's flattening Reshape is placed right after the node that makes it, so TVM's
frontend binds that node where it stands (compiler/units.anchor_outputs says why that
matters for memory); the Concats sit at the end, `CHUNK` inputs each, in a tree (one
Concat of hundreds of inputs compiles to a kernel with a chain of hundreds of branches per
element: optimizer.build_optimizer_graph).
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .optimizer import buckets

CHUNK = 16  # inputs per Concat


def flat_lora_io(model: onnx.ModelProto, shapes: dict[str, tuple[int, ...]]) -> onnx.ModelProto:
    """`model` taking `<bucket>.param` and writing `<bucket>.grad` (if it has gradient outputs)
    in place of the per-tensor LoRA inputs and `<name>.grad` outputs; `shapes` is the LoRA
    tensors' name -> shape, as the runtime's buckets are made from it."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    inputs = {i.name: i for i in g.input}
    outputs = {o.name: o for o in g.output}
    bks = buckets(shapes)
    missing = [n for n in shapes if n not in inputs]
    if missing:
        raise ValueError(f"flat_lora_io: the graph has no input {missing[0]}")
    elem = inputs[next(iter(shapes))].type.tensor_type.elem_type
    consts = _Consts(g)
    head, after, tail = [], {}, []  # slices first; reshapes after their producers; concats last
    by_output = {o: n for n in g.node for o in n.output}
    for b in bks:
        flat = f"{b.key}.param"
        g.input.append(helper.make_tensor_value_info(flat, elem, [b.size]))
        for name, off, shape in b.entries:
            g.input.remove(inputs[name])
            n = int(np.prod(shape))
            head += [helper.make_node("Slice", [flat, consts.ints(off), consts.ints(off + n), consts.ints(0)],
                                      [f"{name}__flat"]),
                     helper.make_node("Reshape", [f"{name}__flat", consts.ints(*shape)], [name])]
        grads = [f"{name}.grad" for name, _, _ in b.entries]
        if not any(gname in outputs for gname in grads):
            continue
        if not all(gname in outputs for gname in grads):
            raise ValueError(f"flat_lora_io: the graph writes only some gradients of bucket {b.key}")
        pieces = []
        for gname in grads:
            src = _through_identity(gname, by_output)
            piece = f"{gname}__flat"
            after.setdefault(src, []).append(helper.make_node("Reshape", [src, consts.ints(-1)], [piece]))
            pieces.append(piece)
            g.output.remove(outputs[gname])
        tail += _concat_tree(pieces, f"{b.key}.grad")
        g.output.append(helper.make_tensor_value_info(f"{b.key}.grad", elem, [b.size]))
    nodes = list(g.node)
    del g.node[:]
    g.node.extend(head)
    for src in [i.name for i in g.input if i.name in after]:  # a gradient that is a graph input
        g.node.extend(after.pop(src))
    for node in nodes:
        g.node.append(node)
        for o in node.output:
            g.node.extend(after.pop(o, []))
    g.node.extend(tail)
    _drop_dead(g)
    onnx.checker.check_model(out, full_check=True)
    return out


def _through_identity(name: str, by_output: dict) -> str:
    """The value an output names (lorac's graphs name outputs with Identity nodes)."""
    node = by_output.get(name)
    while node is not None and node.op_type == "Identity":
        name = node.input[0]
        node = by_output.get(name)
    return name


def _concat_tree(pieces: list[str], out: str) -> list:
    nodes, level = [], 0
    while len(pieces) > CHUNK:
        nxt = []
        for i in range(0, len(pieces), CHUNK):
            name = f"{out}__cat{level}_{i // CHUNK}"
            nodes.append(helper.make_node("Concat", pieces[i:i + CHUNK], [name], axis=0))
            nxt.append(name)
        pieces, level = nxt, level + 1
    nodes.append(helper.make_node("Concat", pieces, [out], axis=0) if len(pieces) > 1
                 else helper.make_node("Identity", pieces, [out]))
    return nodes


def _drop_dead(g) -> None:
    """Remove the nodes nothing reads any more (the Identity nodes of the per-tensor outputs)."""
    while True:
        used = {i for n in g.node for i in n.input} | {o.name for o in g.output}
        live = [n for n in g.node if any(o in used for o in n.output)]
        if len(live) == len(g.node):
            return
        del g.node[:]
        g.node.extend(live)


class _Consts:
    """int64 initializers, one per distinct value."""

    def __init__(self, g):
        self.g, self.made = g, {}

    def ints(self, *values: int) -> str:
        if values not in self.made:
            name = f"flat_lora__i64_{len(self.made)}"
            self.g.initializer.append(numpy_helper.from_array(np.asarray(values, np.int64), name))
            self.made[values] = name
        return self.made[values]
