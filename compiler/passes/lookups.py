"""Lookups into small constant tables fused with what feeds and reads them.

A quantized weight is dequantized through gathers into tables of a few hundred values: NF4's
16 codes indexed by the packed bytes' nibbles (graphs/ops/quant.py nf4_codes), the
double-quantized absmax's 256-entry code, GGUF's 64 powers of two. TVM's AnnotateTIROpPattern marks every
legalized `take` opaque (its read address depends on a loaded value), so FuseOps leaves each
one a kernel of its own: the bytes widened to int32 in one kernel, the gather writing fp32
pairs in a second, the scale and the cast to bf16 in a third. At a Llama-3-8B projection that
is ~350 MB of intermediates per read and ~14 bytes of memory traffic per weight value where
2.5 would do, three times a step (forward, recompute, backward).

A gather is injective (each output element reads one input element, at an address computed
from its own index), as Relay registered `take`: this pass marks the takes whose table holds
at most LOOKUP_MAX values injective, so FuseOps makes the widening, the lookup, the scale
and the cast one kernel that reads the packed bytes and writes the dequantized weight.
A real model's embedding lookups (tables of vocabulary x hidden, millions of values) keep
TVM's pattern: nothing changes there (a toy model's table under the bound fuses too).
Runs between AnnotateTIROpPattern and FuseOps; the values are unchanged (the same loads and
the same arithmetic, in one kernel).
"""
from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from .rewrite import eliminate_dead_code, rewrite_functions

LOOKUP_MAX = 4096  # values in a table whose lookups fuse (NF4 codes: 16, nested absmax code: 256, GGUF powers of two: 64)
_INJECTIVE = 2     # tvm::relax::OpPatternKind::kInjective
_OPAQUE = 8


def _table_size(func) -> int | None:
    """The number of values in a legalized take's table (its first parameter), if static."""
    if not func.params:
        return None
    n = 1
    for d in getattr(func.params[0], "shape", None) or ():  # 0.27's tirx: parameters are buffers
        if not hasattr(d, "value"):  # a symbolic extent
            return None
        n *= int(d.value)
    return n


def is_small_lookup(name: str, func) -> bool:
    attrs = func.attrs
    if not name.startswith("take") or attrs is None or int(attrs.get("op_pattern", -1)) != _OPAQUE:
        return False
    n = _table_size(func)
    return n is not None and n <= LOOKUP_MAX


@tvm.transform.module_pass(opt_level=0, name="LoracInjectiveLookups")
def InjectiveLookups(mod, _ctx):  # noqa: N802 - a pass, named as TVM's
    for gv, func in list(mod.functions.items()):
        if type(func).__name__ == "PrimFunc" and is_small_lookup(gv.name_hint, func):
            mod[gv] = func.with_attr("op_pattern", _INJECTIVE)
    return mod


# -- indices that cannot be negative ---------------------------------------------------------
# ONNX Gather allows negative indices, so TVM's frontend wraps every signed index as
# where(idx < 0, idx + extent, idx). The dequantizations index their tables by bytes widened
# to int32 (ONNX Gather takes no uint8 index): the wrap can never fire, yet its comparison
# leaves a bool in the fused kernel, which keeps it off the vectorized schedule
# (compiler/targets/_gpu_schedule.py) - one element a thread, a quarter of the bandwidth
# (an 8B NF4 step: ~75 ms of dequantization). Dropped where the index is an unsigned value
# widened to a signed type (values unchanged).

def _bound(mutator, expr):
    """What a dataflow var is bound to (the expression itself otherwise)."""
    if isinstance(expr, relax.Var):
        got = mutator.lookup_binding(expr)
        return expr if got is None else got
    return expr


def _widened_unsigned(mutator, x) -> bool:
    """x = astype(u) with u unsigned and the cast to a wider signed integer type."""
    v = _bound(mutator, x)
    if not (isinstance(v, relax.Call) and v.op == tvm.ir.Op.get("relax.astype")):
        return False
    src, dst = str(v.args[0].ty.dtype), str(v.ty.dtype)
    return src.startswith("uint") and dst.startswith("int") and int(dst[3:] or 0) > int(src[4:] or 0)


def _zero(mutator, c) -> bool:
    c = _bound(mutator, c)
    if not isinstance(c, tvm.ir.expr.Constant):
        return False
    v = c.value.numpy()
    return v.size == 1 and int(v.reshape(())) == 0


@mutator
class _UnwrapUnsignedIndices(PyExprMutator):
    def visit_call_(self, call):
        call = super().visit_call_(call)
        op = tvm.ir.Op.get
        if not (isinstance(call.op, tvm.ir.Op) and call.op == op("relax.where")):
            return call
        cond, wrapped, idx = call.args
        c = _bound(self, cond)
        if isinstance(c, relax.Call) and c.op == op("relax.less") and c.args[0].same_as(idx) \
                and _zero(self, c.args[1]) and _widened_unsigned(self, idx):
            w = _bound(self, wrapped)
            if isinstance(w, relax.Call) and w.op == op("relax.add") and w.args[0].same_as(idx):
                return idx
        return call


def unwrap_unsigned_indices(mod: tvm.IRModule) -> tvm.IRModule:
    """Every where(idx < 0, idx + n, idx) whose idx is a widened unsigned value -> idx (and the
    aliases and the comparisons and adds left unused removed, so the widening fuses into the
    lookup)."""
    mod = relax.transform.CanonicalizeBindings()(rewrite_functions(_UnwrapUnsignedIndices(mod), mod))
    return eliminate_dead_code(mod)
