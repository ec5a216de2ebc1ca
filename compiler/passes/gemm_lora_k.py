"""A wide LoRA projection over a dequantized weight becomes one GEMM: y = [x | u] [W | B]^T.

After sum fusion (gemm_sum.py) and bf16 outputs (gemm_output.py), an adapted projection's
forward is `lorac.gemm_acc_ntnt(u, B, x, W)`: the rank-r term u B^T writes y, then the frozen
GEMM x W^T reads y back in its epilogue and adds into it. Where y is much wider than x (gate and
up: [T, 14336] from [T, 4096] at Llama-3-8B) those two passes over y cost more than the
projection's LoRA arithmetic: on the H100, 93 us for u B^T and ~80 us of extra epilogue reads,
against ~1.1 ms for the GEMM itself, at every forward and every recompute of a layer. Here
such a call becomes `lorac.gemm_nt(concat(x, u), concat(W, B))`: one GEMM over a reduction r
longer (K = in + r, r/in of its FLOPs more), y written once. The concatenation of x costs one
copy of x (~4x narrower than y); that of W and B costs nothing where W is dequantized in the
step (its dequantization kernel writes the wider rows: FuseOps puts the concat in it), so the
rewrite applies only there (a weight computed in the step, not a parameter) and only where y
is at least LORA_K_WIDE times as wide as x (the copy of x then costs less than the pass over y
it saves). The sum is the same up to fp32 accumulation order; the
bf16 rounding of u B^T before the add is gone (one rounding of y instead of two).
"""
from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from lorac.core.constants import LORA_K_WIDE

from .gemm import GEMM_PREFIX, _static_shape
from .gemm_sum import ACC_PREFIX
from .rewrite import rewrite_functions

LANES = 4  # the concatenations' vector width: in and r multiples of it
_DPS = tvm.ir.Op.get("relax.call_dps_packed")


@mutator
class _Concat(PyExprMutator):
    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.rewritten = 0

    def visit_call_(self, call: relax.Call):
        call = super().visit_call_(call)
        if call.op != _DPS or call.args[0].global_symbol != ACC_PREFIX + "ntnt":
            return call
        u, b, x, w = call.args[1].fields
        su, sb, sx, sw = (_static_shape(v.ty) for v in (u, b, x, w))
        if None in (su, sb, sx, sw) or len(sx) != 2 or len(sw) != 2:
            return call
        (tokens, r), (out, inp) = su, sw
        if sx != [tokens, inp] or sb != [out, r] or r >= inp or out < LORA_K_WIDE * inp or r % LANES or inp % LANES:
            return call
        if any(str(v.ty.dtype) != "bfloat16" for v in (u, b, x, w)) or self.lookup_binding(w) is None:
            return call  # a parameter: its concat would be a copy of W every step
        # the values themselves, not their aliases (`lv = lv73`): FuseOps fuses no producer into the
        # concat through an alias, and W's dequantization must write the concatenated rows
        xu = self.builder_.emit(_concat_columns(self._root(x), self._root(u)))
        wb = self.builder_.emit(_concat_columns(self._root(w), self._root(b)))
        self.rewritten += 1
        return relax.call_dps_packed(GEMM_PREFIX + "nt", [xu, wb], call.ty)


    def _root(self, v):
        while isinstance(v, relax.Var) and isinstance(self.lookup_binding(v), relax.Var):
            v = self.lookup_binding(v)
        return v


def _concat_columns(a, b):
    """[rows, n] and [rows, m] side by side -> [rows, n + m], as a concat of [rows, n / LANES, LANES]
    blocks: the fused kernel's choice between a and b is then the same for the LANES elements of a
    vector, which keeps it vectorized (a choice per element makes TVM write one element at a time)."""
    (rows, n), m = _static_shape(a.ty), _static_shape(b.ty)[1]
    blocks = [relax.op.reshape(v, [rows, k // LANES, LANES]) for v, k in ((a, n), (b, m))]
    return relax.op.reshape(relax.op.concat(blocks, axis=1), [rows, n + m])


def concat_lora_gemms(mod: tvm.IRModule) -> tuple[tvm.IRModule, int]:
    """-> (module, how many projections became one GEMM)."""
    rewriter = _Concat(mod)
    mod = rewrite_functions(rewriter, mod)
    if rewriter.rewritten:
        mod = relax.transform.DeadCodeElimination()(mod)  # the aliases the concats skip
    return mod, rewriter.rewritten
