"""Legalize each distinct op signature once (compile time of deep graphs).

TVM's LegalizeOps builds a TE compute and a fresh PrimFunc for every op *call*; a 28-layer
training graph has ~4,400 calls but only a few hundred distinct (op, attributes, argument
types) signatures, because every layer repeats the same shapes. Later passes merge the
identical PrimFuncs again, but the building alone took ~4 s of a ~15 s Qwen3-0.6B compile.

`CachedLegalize` runs before LegalizeOps: for each op call it legalizes the first call of a
signature through the op's own FLegalize, and when the result is a single `call_tir` over the
call's arguments in order, every later call of that signature becomes a `call_tir` to the
same PrimFunc. Anything else (ops without FLegalize, composite legalizations) is left for
LegalizeOps, so the result is the module LegalizeOps would give, with shared PrimFuncs.
"""
from __future__ import annotations

import tvm
import tvm_ffi
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from .rewrite import rewrite_functions


def _canonical(call: relax.Call):
    """(call with every distinct Var argument, also inside a Tuple, replaced by a typed
    placeholder; the distinct Vars in order). Constants, shapes and other values stay part of
    the signature."""
    found, holders = [], []

    def canon(a):
        if isinstance(a, relax.Var):
            for v, h in zip(found, holders):  # a repeated variable keeps one placeholder:
                if v.same_as(a):  # mul(x, x) may legalize to a one-argument PrimFunc
                    return h
            found.append(a)
            holders.append(relax.Var(f"a{len(found)}", a.ty))
            return holders[-1]
        if isinstance(a, relax.Tuple):
            return relax.Tuple([canon(f) for f in a.fields])
        return a

    args = [canon(a) for a in call.args]
    return relax.Call(call.op, args, call.attrs, call.ty_args), found


@mutator
class _Legalizer(PyExprMutator):
    def __init__(self, mod):
        super().__init__(mod)
        # signature hash -> [(canonical call, PrimFunc gvar, positions of its args, out type)]
        self.cache: dict[int, list] = {}

    def visit_call_(self, call):
        call = super().visit_call_(call)
        if not isinstance(call.op, tvm.ir.Op):
            return call
        legalize = call.op.get_attr("FLegalize")
        if legalize is None:
            return call
        canon, vars_ = _canonical(call)
        h = tvm_ffi.structural_hash(canon, map_free_vars=True)
        for seen, gvar, pos, out_ty in self.cache.get(h, []):
            if tvm_ffi.structural_equal(seen, canon, map_free_vars=True):
                return relax.call_tir(gvar, [vars_[i] for i in pos], out_ty)
        new = legalize(self.builder_, call)
        if (isinstance(new, relax.Call) and new.op == _CALL_TIR and len(new.args) == 2
                and isinstance(new.args[0], relax.GlobalVar) and isinstance(new.args[1], relax.Tuple)):
            ids = [next((i for i, v in enumerate(vars_) if v.same_as(a)), None) for a in new.args[1].fields]
            if None not in ids:  # every PrimFunc argument is one of the call's variables
                self.cache.setdefault(h, []).append((canon, new.args[0], ids, new.ty_args[0]))
        return new


_CALL_TIR = tvm.ir.Op.get("relax.call_tir")


@tvm.transform.module_pass(opt_level=0, name="LoracCachedLegalize")
def CachedLegalize(mod, _ctx):  # noqa: N802 - a pass, named like TVM's
    return rewrite_functions(_Legalizer(mod), mod)
