"""bf16 residual stream: the sums a decoder's layers add into are stored in bfloat16.

In a bf16 build every GEMM already writes its activations in bf16 (gemm_output.py), but a
residual add, x1 = x + o_proj(...), still wrote the fp32 sum of two bf16 values: each
layer's two residual sums were fp32 [tokens, hidden] tensors, read by the norms after them
and kept for the norms' backward. Here such a sum is stored in bf16, as a bf16 model in
transformers stores its hidden states: the add still computes in fp32 inside its kernel
and rounds once as it writes, every reader widens its own copy (fused into the reader),
and the backward reads the value the forward read. On a Llama-3-8B shape at 4x2048 that is
134 MB less per layer that keeps its activations (docs/BENCHMARKS.md).

Which adds: an fp32 `R.add` of two operands of one static shape (no broadcast: not a bias)
where one operand is a stream value, i.e. a bf16 value widened (a bf16 GEMM's output, the
embedding rows; also through a reshape or a product with a scalar: Gemma's embedding scale)
or a sum this pass already narrows; the other operand may be anything (Gemma 2 adds a norm's
output). The gradient stream's sums, which add fp32 results of the norms' backward kernels,
are narrowed by their own rule (gradient_sums).

With them go the values read only in bf16 anyway (read_narrow): every widening of a bf16
value, the final norm's output, each LoRA projection's s x A^T.

A family whose reference keeps the residual in fp32 (HF Mamba's `residual_in_fp32`) says so
in its graph's metadata (graphs/compose.RESIDUAL_KEY), and nothing is narrowed there, the
gradient stream included.
"""
from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from lorac.graphs.compose import RESIDUAL_KEY  # noqa: F401 - read by pipeline.py

from .gemm import _static_shape
from .gemm_output import narrow_values
from .rewrite import dataflow_blocks

_ADD = tvm.ir.Op.get("relax.add")
_ASTYPE = tvm.ir.Op.get("relax.astype")
_RESHAPE = tvm.ir.Op.get("relax.reshape")
_MULTIPLY = tvm.ir.Op.get("relax.multiply")
_VIEWS = (_RESHAPE, tvm.ir.Op.get("relax.strided_slice"))


def _scalar(e) -> bool:
    shape = _static_shape(e.ty) if isinstance(e, tvm.ir.expr.Constant) else None
    return shape is not None and int(np.prod(shape)) == 1


def _is_stream(e, values: dict, narrowed: set, dtype: str) -> bool:
    while isinstance(e, relax.Var):
        if e in narrowed:
            return True
        e = values.get(e)
    if not isinstance(e, relax.Call):
        return False
    if e.op == _RESHAPE:
        return _is_stream(e.args[0], values, narrowed, dtype)
    if e.op == _MULTIPLY and any(_scalar(a) for a in e.args):  # Gemma's embedding times sqrt(D)
        return any(_is_stream(a, values, narrowed, dtype) for a in e.args if not _scalar(a))
    return e.op == _ASTYPE and str(e.args[0].ty.dtype) == dtype


def _fp32_sum(b) -> bool:
    """Whether binding b is a dataflow var's fp32 `R.add` of two operands of one static shape of
    rank >= 2 (no broadcast: not a bias): what residual_sums and gradient_sums choose among."""
    v = b.value
    if not (isinstance(b.var, relax.DataflowVar) and isinstance(v, relax.Call) and v.op == _ADD
            and isinstance(b.var.ty, relax.TensorType) and str(b.var.ty.dtype) == "float32"):
        return False
    shapes = [_static_shape(a.ty) for a in v.args]
    return shapes[0] is not None and shapes[0] == shapes[1] and len(shapes[0]) >= 2


def residual_sums(mod: tvm.IRModule, dtype: str = "bfloat16") -> set:
    """The dataflow vars of `mod` bound to a residual sum (the module docstring's rule)."""
    narrowed: set = set()
    for block in dataflow_blocks(mod):
        values = {b.var: b.value for b in block.bindings}
        for b in block.bindings:
            if _fp32_sum(b) and any(_is_stream(a, values, narrowed, dtype) for a in b.value.args):
                narrowed.add(b.var)
    return narrowed


def gradient_sums(mod: tvm.IRModule, dtype: str = "bfloat16") -> set:
    """The dataflow vars bound to a sum of the gradient stream: an fp32 `R.add` of two fp32
    results of one static shape (neither a widened `dtype` value: those are the forward's
    residual sums) that a GEMM reads (one of its readers narrows it to `dtype`). Each layer's
    backward adds its norms' input gradients into the gradient of its output twice, and every
    such sum fed a GEMM through a cast kernel of its own besides the next norm's kernels:
    stored in `dtype`, as the forward's residual sums are (and as a bf16 model's gradients are
    in PyTorch), the add still computes in fp32 inside its kernel and rounds once as it writes,
    the GEMMs read it as it is and the other readers widen their own copies."""
    found: set = set()
    for block in dataflow_blocks(mod):
        values = {b.var: b.value for b in block.bindings}
        users = relax.analysis.udchain(block)
        for b in block.bindings:
            if not _fp32_sum(b) or any(str(a.ty.dtype) != "float32" or _is_stream(a, values, set(), dtype)
                                       for a in b.value.args):
                continue
            narrows = [isinstance(values.get(u), relax.Call) and values[u].op == _ASTYPE
                       and str(values[u].attrs.dtype) == dtype for u in users.get(b.var, ())]
            if any(narrows) and not all(narrows):  # read by a GEMM and by others (one reader: fused)
                found.add(b.var)
    return found


def read_narrow(mod: tvm.IRModule, dtype: str = "bfloat16") -> set:
    """The fp32 dataflow vars stored in `dtype` at no cost: every widening of a `dtype` value
    (the embedding's rows, the stream's first value; a checkpointed layer's input fetched back
    from host memory), whose readers then widen their own copies inside their kernels instead
    of all reading one fp32 copy a kernel of its own wrote, and every value all of
    whose readers narrow it again, directly or after a slice or reshape (the final norm's
    output, read by the loss chunks' GEMMs; a LoRA projection's s x A^T, read by its B and
    dB GEMMs): stored narrow, they read the same values."""
    found: set = set()
    for block in dataflow_blocks(mod):
        values = {b.var: b.value for b in block.bindings}
        users = relax.analysis.udchain(block)

        def narrows(var) -> bool:
            v = values.get(var)
            return isinstance(v, relax.Call) and v.op == _ASTYPE and str(v.attrs.dtype) == dtype

        for var, v in values.items():
            if not (isinstance(var, relax.DataflowVar) and isinstance(var.ty, relax.TensorType)
                    and str(var.ty.dtype) == "float32" and _static_shape(var.ty)):
                continue
            if isinstance(v, relax.Call) and v.op == _ASTYPE and str(v.args[0].ty.dtype) == dtype:
                found.add(var)  # a widening: each reader widens its own copy instead
                continue
            readers = list(users.get(var, ()))
            if readers and all(narrows(u) or (isinstance(values.get(u), relax.Call) and values[u].op in _VIEWS
                                              and users.get(u) and all(narrows(w) for w in users[u]))
                               for u in readers):
                found.add(var)
    return found


def narrow_residuals(mod: tvm.IRModule, dtype: str = "bfloat16") -> tuple[tvm.IRModule, int, int, int]:
    """-> (module, number of residual sums, of gradient sums and of read_narrow's values now
    stored in `dtype`)."""
    sums, grads, others = residual_sums(mod, dtype), gradient_sums(mod, dtype), read_narrow(mod, dtype)
    return narrow_values(mod, sums | grads | others, dtype)[0], len(sums), len(grads), len(others - sums - grads)
