"""Units: how the compiler treats the lorac-domain local functions of a graph.

A unit (graphs/builder.GraphBuilder.call) is a node calling an ONNX local function whose
body is default-domain ops. TVM's ONNX frontend reads only the default domain, so for
each build the target decides, per unit name, one of two things:

- inline: the body replaces the call (onnx.inliner) and TVM compiles it like any other
  ops. The default, and what every target does for units it does not name.
- map whole: the target's `native_units(dtype)` names a converter class for it; while
  the frontend runs, lorac's converters join its op table (`frontend_with`), and each
  call becomes a `call_dps_packed` of a runtime-registered function (as the GEMMs do),
  e.g. cuDNN's fused attention on CUDA (compiler/attention_cudnn.py).

The manifest lists the mapped units (`units`), so the runtime registers their functions
before loading the library.
"""
from __future__ import annotations

import contextlib

import onnx

from lorac.graphs.builder import DOMAIN, inline_units


def split_units(model: onnx.ModelProto, native: dict) -> tuple[onnx.ModelProto, list[str]]:
    """(model with every unit the target does not map inlined, names of the mapped units
    the model uses)."""
    used = sorted({n.op_type for n in model.graph.node if n.domain == DOMAIN})
    mapped = [u for u in used if u in native]
    return inline_units(model, keep=tuple(mapped)), mapped


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
