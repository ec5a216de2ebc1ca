"""Lookups into small constant tables fused with what feeds and reads them.

A quantized weight is dequantized through gathers into tables of a few hundred values: NF4's
256 code pairs indexed by the packed bytes (graphs/ops/quant.py nf4_codes), the double-quantized
absmax's 256-entry code, GGUF's 64 powers of two. TVM's AnnotateTIROpPattern marks every
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

LOOKUP_MAX = 4096  # values in a table whose lookups fuse (NF4 pairs: 512, GGUF's powers of two: 64)
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
