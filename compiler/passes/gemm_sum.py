"""Sums of GEMMs become one accumulating GEMM call: out = a1 op b1 + a2 op b2 + ...

After GEMM dispatch (gemm.py) a LoRA projection's forward is y = (x W^T) + (u B^T) and the
input gradient of q/k/v is a chain of Adds over six GEMM results. Each Add read two fp32
[N, out] tensors and wrote a third, and each GEMM wrote its own: on the Qwen3-0.6B step
those passes over fp32 activations were a large share of the TVM kernels' time. Here an
`R.add` whose operands are both GEMM results used nowhere else becomes one call of
`lorac.gemm_acc_<layouts>` (e.g. `lorac.gemm_acc_ntnt`, two letters per pair as in
`lorac.gemm_<ta><tb>`), which the runtime runs as the first GEMM writing `out` and each
further one accumulating into it (cuBLAS beta = 1). The terms go in order of their
reduction length: a LoRA term (K = r) writes `out` first and the frozen GEMM adds into it. Targets opt in (ACCUMULATING_GEMMS). Chains fold:
an accumulating call used only by another such Add joins it. The replaced GEMMs are dead
afterwards and eliminate_dead_code drops them.
"""
from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from .gemm import GEMM_PREFIX, _static_shape
from .rewrite import dataflow_blocks, eliminate_dead_code, rewrite_functions

ACC_PREFIX = GEMM_PREFIX + "acc_"
_ADD = tvm.ir.Op.get("relax.add")
_DPS = tvm.ir.Op.get("relax.call_dps_packed")


def _use_counts(mod: tvm.IRModule) -> dict:
    return {var: len(users) for block in dataflow_blocks(mod) for var, users in relax.analysis.udchain(block).items()}


@mutator
class _SumFuser(PyExprMutator):
    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.uses = _use_counts(mod)
        self.fused = 0

    def _terms_of(self, x):
        """The GEMM terms of an Add operand used nowhere else, else None."""
        if self.uses.get(x) != 1:
            return None
        bound = self.lookup_binding(x)
        return self._gemm_terms(bound) if bound is not None else None

    def visit_call_(self, call: relax.Call):
        call = super().visit_call_(call)
        if call.op != _ADD or str(call.ty.dtype) != "float32":
            return call
        if not all(_same_shape(x.ty, call.ty) for x in call.args):
            return call
        lhs, rhs = (self._terms_of(x) for x in call.args)
        if lhs is None or rhs is None:
            return call
        # the thinnest reduction first: it writes `out` and the big GEMMs add into it, reading
        # it in their epilogue while they compute, instead of a rank-r GEMM reading and
        # rewriting the whole output after them
        terms = sorted(lhs + rhs, key=_reduced_length)
        name = ACC_PREFIX + "".join(layout for layout, _, _ in terms)
        self.fused += 1
        return relax.call_dps_packed(name, [x for _, a, b in terms for x in (a, b)], call.ty)

    @staticmethod
    def _gemm_terms(value):
        """[(layout, a, b)] of a plain GEMM call or an accumulating one, else None."""
        if not (isinstance(value, relax.Call) and value.op == _DPS):
            return None
        name = value.args[0].global_symbol
        args = list(value.args[1].fields)
        if name.startswith(ACC_PREFIX):
            letters = name[len(ACC_PREFIX):]
            return [(letters[2 * i:2 * i + 2], args[2 * i], args[2 * i + 1]) for i in range(len(args) // 2)]
        if name.startswith(GEMM_PREFIX) and len(args) == 2 and str(value.ty.dtype) == "float32":
            return [(name[len(GEMM_PREFIX):], args[0], args[1])]
        return None


def _reduced_length(term) -> int:
    """K of a (layout, a, b) term: the length its GEMM sums over."""
    layout, a, _ = term
    shape = _static_shape(a.ty)
    return shape[-2] if layout[0] == "t" else shape[-1]


def _same_shape(a, b) -> bool:
    sa, sb = _static_shape(a), _static_shape(b)
    return sa is not None and sa == sb


def fuse_gemm_sums(mod: tvm.IRModule) -> tuple[tvm.IRModule, list[str]]:
    """-> (module, the accumulating function names it calls: the runtime registers them)."""
    fuser = _SumFuser(mod)
    mod = rewrite_functions(fuser, mod)
    if not fuser.fused:
        return mod, []
    mod = eliminate_dead_code(mod)  # the absorbed GEMMs and inner sums
    names = set()
    for func in mod.functions.values():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func, lambda e: names.add(e.args[0].global_symbol) if isinstance(
                e, relax.Call) and e.op == _DPS and e.args[0].global_symbol.startswith(ACC_PREFIX) else None)
    return mod, sorted(names)
