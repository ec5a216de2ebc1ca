"""Units: how the compiler treats the lorac-domain local functions of a graph.

A unit (graphs/builder.GraphBuilder.call) is a node calling an ONNX local function whose
body is default-domain ops. TVM's ONNX frontend reads only the default domain, so for
each build the target decides, per unit name, one of two things:

- inline: the body replaces the call (onnx.inliner) and TVM compiles it like any other
  ops. The default, and what every target does for units it does not name.
- map whole: the target's `native_units(dtype)` names a converter class for it; while
  the frontend runs, lorac's converters join its op table (`frontend_with`), and each
  call becomes a `call_dps_packed` of a runtime-registered function (as the GEMMs do),
  e.g. cuDNN's fused attention on CUDA (compiler/attention_cudnn.py), or a `call_tir` of
  a TIR kernel lorac writes itself, e.g. Mamba's selective scan on the CPU and CUDA
  (compiler/scan_units.py).

The manifest lists the mapped units (`units`), so the runtime registers their functions
before loading the library.
"""
from __future__ import annotations

import contextlib
import re

import onnx

from lorac.graphs.builder import DOMAIN, inline_units


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
# times the states for every layer: docs/MAMBA.md)
KEPT_APART = ("SelectiveScan", "SelectiveScanGrad")


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
    reaches its converter like any default-domain op."""
    from tvm.relax.frontend.onnx import onnx_frontend

    if not converters:
        yield
        return
    original = onnx_frontend._get_convert_map
    onnx_frontend._get_convert_map = lambda: {**original(), **converters}
    try:
        yield
    finally:
        onnx_frontend._get_convert_map = original
