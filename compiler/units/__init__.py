"""Units: how the compiler treats the lorac-domain local functions of a graph.

A unit (graphs/builder.GraphBuilder.call) is a node calling an ONNX local function whose
body is default-domain ops. TVM's ONNX frontend reads only the default domain, so for
each build the target decides, per unit name, one of two things:

- inline: the body replaces the call (onnx.inliner) and TVM compiles it like any other
  ops. The default, and what every target does for units it does not name.
- map whole: the target's `native_units(dtype)` names a converter class for it; while
  the frontend runs, lorac's converters join its op table (`frontend_with`), and each
  call becomes a `call_dps_packed` of a runtime-registered function (as the GEMMs do),
  e.g. cuDNN's fused attention on CUDA (compiler/targets/cuda/attention.py), or a `call_tir` of
  a TIR kernel lorac writes itself, e.g. Mamba's selective scan on the CPU and CUDA
  (compiler/units/scan.py).

The manifest lists the mapped units (`units`), so the runtime registers their functions
before loading the library.
"""
from __future__ import annotations

import contextlib
import re

import numpy as np
import onnx

from lorac.graphs.builder import DOMAIN, inline_units


def unit_converter(name: str, fn, **attrs):
    """A converter class as TVM's ONNX frontend holds them in its op table
    (`get_converter(opset)` -> fn(bb, inputs, attrs, params)), with `attrs` as class
    attributes (the attention converters' `unit_calls`): what a target's native_units maps."""
    return type(name, (), {**attrs, "get_converter": classmethod(lambda cls, _opset: fn)})


def split_units(model: onnx.ModelProto, native: dict) -> tuple[onnx.ModelProto, list[str]]:
    """(model with every unit the target does not map inlined, names of the mapped units
    the model uses)."""
    used = sorted({n.op_type for n in model.graph.node if n.domain == DOMAIN})
    mapped = [u for u in used if u in native]
    inlined = inline_units(model, keep=tuple(mapped))
    return (dedupe_inlined(inlined) if len(mapped) < len(used) else inlined), mapped


# onnx.inliner names each node of an inlined body <name>__<k>; body nodes are named
# <unit>/<op>_<n> (GraphBuilder.call)
_INLINED = re.compile(r"^(\w+)/.*__\d+$")
# units whose inlined bodies never merge with others: the scan's backward recomputes its
# forward's [B, C, L, L, I, M] decay block on purpose (kept from the forward it would cost L
# times the states for every layer: docs/MAMBA.md); SwiGLU's backward computes sigmoid(gate)
# once per result on purpose (graphs/ops/mlp.py)
KEPT_APART = ("SelectiveScan", "SelectiveScanGrad", "SwiGLUGrad", "SwiGLUGradAct")


def dedupe_inlined(model: onnx.ModelProto) -> onnx.ModelProto:
    """Merge the nodes of inlined unit bodies that compute the same thing from the same
    values (common subexpressions). An attention backward recomputes the forward's masked
    scores from the same q and k, and transposes q, k, v as the forward did: merged, the
    backward reads what the forward computed (as the CPU path did before attention became
    units: one q k^T GEMM a layer instead of two). Only inlined nodes merge, so a
    checkpointed layer's recomputed forward (its own q and k) stays apart from the original;
    and none of the units in KEPT_APART."""
    seen: dict = {}
    rename: dict = {}
    keep = []
    for node in model.graph.node:
        for i, name in enumerate(node.input):
            if name in rename:
                node.input[i] = rename[name]
        unit = _INLINED.match(node.name)
        if unit is None or unit.group(1) in KEPT_APART:
            keep.append(node)
            continue
        key = (node.domain, node.op_type, tuple(node.input),
               tuple(a.SerializeToString() for a in sorted(node.attribute, key=lambda a: a.name)))
        hit = seen.get(key)
        if hit is None:
            seen[key] = list(node.output)
            keep.append(node)
        else:
            rename.update(zip(node.output, hit))
    for out in model.graph.output:
        out.name = rename.get(out.name, out.name)
    del model.graph.node[:]
    model.graph.node.extend(keep)
    return model


@contextlib.contextmanager
def frontend_with(converters: dict):
    """TVM's ONNX frontend with `converters` (op type -> converter class) added to its
    op table for the duration: the frontend dispatches on op_type alone, so a unit call
    reaches its converter like any default-domain op. Also for the duration, a MatMul is
    bound where the node stands (`_bound_in_order`)."""
    from tvm.relax.frontend.onnx import onnx_frontend

    original = onnx_frontend._get_convert_map
    importer = onnx_frontend.ONNXGraphImporter
    convert = importer._convert_operator
    if converters:
        onnx_frontend._get_convert_map = lambda: {**original(), **converters}
    importer._convert_operator = _bound_in_order(convert)
    try:
        yield
    finally:
        onnx_frontend._get_convert_map = original
        importer._convert_operator = convert


def _bound_in_order(convert):
    """The frontend's per-node conversion, with a MatMul's call bound at once.

    TVM's ONNX frontend leaves a converted call unbound until a later node reads it, so
    a node runs where its first reader stands, not where the graph put it, and its
    inputs live until then. In lorac's graphs emission order is execution order
    (graphs/compose.py). For a GEMM that costs memory: its inputs are the big
    activations. A Llama-3-8B-shape step's four loss-chunk gradient GEMMs (dh =
    dlogits E) were all bound at the Concat after the last chunk, keeping every chunk's
    [2048, 128256] dlogits alive together. Bound in order, the step's static plan drops
    by 1.5 GB without checkpointing and by 1.1 GB with it. Elementwise nodes stay as
    they were (they fuse into their readers anyway); binding every node in order made
    the checkpointed plan larger, as FuseOps then moved LoRA gradient GEMMs to the end."""
    from tvm import relax

    def bound(self, op_name, *args):
        sym = convert(self, op_name, *args)
        if op_name == "MatMul" and isinstance(sym, relax.Call) and isinstance(sym.ty, relax.TensorType):
            return self.bb.emit(sym)
        return sym

    return bound


def anchor_outputs(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` with each graph output written at the end by a sum over a new axis of length
    one (the value itself), whose Unsqueeze reads the producer (looking through Identity)
    right where the producer stands.

    TVM's ONNX frontend binds a node's expression only when a later node reads it. A node
    read only by the graph's outputs (a LoRA weight gradient dA = du^T x) was therefore
    bound after the last node of the whole graph, and its inputs (the layer's [tokens,
    features] activations) stayed alive until the end of the step: with checkpointing,
    the static plan of a Llama-3-8B-shape step grew by five [8192, 14336] buffers a
    layer (54.7 GB for 32 layers). Read by the sum, the producer is bound where it stands
    (inside the CUDA graphs); the sum, bound at the end, writes the output: one small
    kernel per output, outside the graphs as output writers are, where the GEMMs
    themselves were before. (A multiplication by one would do, but TVM turns a kernel that
    copies into a reshape, and the GEMM would write the output again.) A unit's outputs are
    left as they are."""
    from onnx import TensorProto, helper, numpy_helper

    by_output = {o: n for n in model.graph.node for o in n.output}
    types = {o.name: o.type.tensor_type.elem_type for o in model.graph.output}
    anchors: dict = {}  # producer's output name -> ([Unsqueeze, ReduceSum], the sum's output)
    naming = set()  # outputs of the Identity nodes on the way from an output to its producer
    for out in model.graph.output:
        name, node = out.name, by_output.get(out.name)
        if node is None or node.op_type != "Identity":  # lorac's graphs name outputs by Identity
            continue
        while node is not None and node.op_type == "Identity":
            naming.add(node.output[0])
            name = node.input[0]
            node = by_output.get(name)
        if node is None or name in anchors or types[out.name] not in (TensorProto.FLOAT, TensorProto.DOUBLE):
            continue
        if node.domain == DOMAIN:  # a unit's kernel writes its outputs where it stands; copying
            continue  # an in-place unit's (the optimizer's AdamWStep) would undo it
        axis = numpy_helper.from_array(np.asarray([-1], np.int64), f"{name}__axis")
        model.graph.initializer.append(axis)
        anchors[name] = ([helper.make_node("Unsqueeze", [name, axis.name], [f"{name}__unsqueezed"]),
                          helper.make_node("ReduceSum", [f"{name}__unsqueezed", axis.name], [f"{name}__anchored"],
                                           keepdims=0)], f"{name}__anchored")
    if not anchors:
        return model
    nodes, names = [], []
    for node in model.graph.node:
        if node.op_type == "Identity" and node.output[0] in naming:  # to the end, after the sums
            if node.input[0] in anchors:
                node.input[0] = anchors[node.input[0]][1]
            names.append(node)
            continue
        nodes.append(node)
        for o in node.output:  # the Unsqueeze right after the producer, which it binds there
            nodes.extend(anchors[o][0][:1] if o in anchors else [])
    nodes += [a[0][1] for a in anchors.values()] + names
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return model
