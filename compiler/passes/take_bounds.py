"""Embedding gathers with clamped indices: ONNX Gather imports as `relax.take(mode="fast")`,
and legalizing a fast take makes TVM print "Fast mode segfaults when there are out-of-bounds
indices" once per graph. lorac's ids are known in bounds (the data loader refuses ids past
the vocabulary), so the warning says nothing; mode "clip" gives the same values for ids in
bounds, adds one min/max per gathered element (nothing next to the row it copies), prints
nothing, and cannot read out of bounds if an id ever were.
"""
from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from .rewrite import rewrite_functions


@mutator
class _ClipTakes(PyExprMutator):
    def visit_call_(self, call):
        call = super().visit_call_(call)
        if isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.take" and call.attrs.mode == "fast":
            axis = None if call.attrs.axis is None else int(call.attrs.axis)
            return self.builder_.normalize(relax.op.take(call.args[0], call.args[1], axis, mode="clip"))
        return call


def clip_takes(mod: tvm.IRModule) -> tvm.IRModule:
    """Every fast-mode `relax.take` -> the same take in clip mode."""
    return rewrite_functions(_ClipTakes(mod), mod)
