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
it saves). Projections of one x (gate and up) share its join: both GEMMs read
[x | u_gate | u_up], against [W_gate | B_gate | 0] and [W_up | 0 | B_up] (the zeros formed in the
joining kernel), so x is copied once a forward. The sum is the same up to fp32 accumulation
order; the bf16 rounding of u B^T before the add is gone (one rounding of y instead of two).
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


def _root(bound: dict, v):
    """The value behind aliases (`lv = lv73`): FuseOps fuses no producer into a concat through an
    alias, and W's dequantization must write the joined rows itself."""
    while isinstance(v, relax.Var) and isinstance(bound.get(v), relax.Var):
        v = bound[v]
    return v


def _operands(value, bound: dict):
    """(u, B, x, W) of a `gemm_acc_ntnt(u, B, x, W)` this pass joins, else None."""
    if not (isinstance(value, relax.Call) and value.op == _DPS and value.args[0].global_symbol == ACC_PREFIX + "ntnt"):
        return None
    u, b, x, w = (_root(bound, v) for v in value.args[1].fields)
    su, sb, sx, sw = (_static_shape(v.ty) for v in (u, b, x, w))
    if None in (su, sb, sx, sw) or len(sx) != 2 or len(sw) != 2:
        return None
    (tokens, r), (out, inp) = su, sw
    if sx != [tokens, inp] or sb != [out, r] or r >= inp or out < LORA_K_WIDE * inp or r % LANES or inp % LANES:
        return None
    if any(str(v.ty.dtype) != "bfloat16" for v in (u, b, x, w)) or _from_parameter(bound, w):
        return None  # its join would be a copy of W every step
    return u, b, x, w


_VIEWS = {tvm.ir.Op.get(f"relax.{name}") for name in ("astype", "reshape", "permute_dims")}


def _from_parameter(bound: dict, v) -> bool:
    """Whether v is a function parameter, or only a cast or reshape of one (not a dequantization)."""
    while v in bound:
        value = bound[v]
        if isinstance(value, relax.Var):
            v = value
        elif isinstance(value, relax.Call) and value.op in _VIEWS:
            v = value.args[0]
        else:
            return False
    return isinstance(v, relax.Var)


def _plan_block(block: relax.DataflowBlock, bound: dict) -> tuple[list, dict]:
    """The block's bindings in an order where every joined projection's u is bound before the
    first projection of its input x (gate's GEMM comes before up's u is sliced out), and
    {binding var: (x, [u of each projection of x], its index)}."""
    binds = list(block.bindings)
    pos = {b.var: i for i, b in enumerate(binds)}
    by_x: dict = {}
    for i, b in enumerate(binds):
        got = _operands(b.value, bound)
        if got is not None:
            by_x.setdefault(got[2], []).append((i, got[0]))
    plan, first = {}, {}

    def alone(x, members):  # each projection joins x with its own u
        for i, u in members:
            plan[binds[i].var] = (x, [u], 0)

    for x, members in by_x.items():
        us = [u for _, u in members]
        if len({_static_shape(u.ty)[1] for u in us}) > 1:  # ranks differ
            alone(x, members)
            continue
        for k, (i, _) in enumerate(members):
            plan[binds[i].var] = (x, us, k)
        first[members[0][0]] = (x, members, [pos[u] for u in us[1:] if u in pos])
    order, done = [], set()

    def emit(i: int, stop: int) -> bool:
        if i in done:
            return True
        if i == stop:  # a later u needs the first projection's own result: no shared join
            return False
        for v in relax.analysis.free_vars(binds[i].value):
            if v in pos and not emit(pos[v], stop):
                return False
        order.append(i)
        done.add(i)
        return True

    for i in range(len(binds)):
        x, members, later = first.get(i, (None, (), ()))
        if not all(emit(j, i) for j in later):
            # a later projection's u needs this one's result: each joins x alone (what was moved
            # up has its dependencies before it, so the order stays valid)
            alone(x, members)
        emit(i, -1)
    return [binds[i] for i in order], plan


@mutator
class _Join(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, plan: dict, bound: dict):
        super().__init__(mod)
        self.plan, self.bound, self.joined, self.rewritten = plan, bound, {}, 0

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        planned = self.plan.get(binding.var)
        if planned is None:
            return super().visit_var_binding_(binding)
        x, us, k = planned
        _, b, _, w = (self.visit_expr(v) for v in _operands(binding.value, self.bound))
        key = (x, tuple(us))
        if key not in self.joined:  # [x | u_1 | ... | u_n], shared by the projections of x
            self.joined[key] = self.builder_.emit(_join_columns([self.visit_expr(v) for v in (x, *us)]))
        # zeros against the other projections' u (their ranks are this one's: _plan_block), formed in
        # the joining kernel as B * 0: a zeros op would be folded into a constant block stored with
        # the artifact, one per projection and layer
        zero = self.builder_.normalize(relax.op.multiply(b, relax.const(0.0, "bfloat16")))
        wb = self.builder_.emit(_join_columns([w] + [b if i == k else zero for i in range(len(us))]))
        self.rewritten += 1
        call = relax.call_dps_packed(GEMM_PREFIX + "nt", [self.joined[key], wb], binding.value.ty)
        self.builder_.emit_normalized(relax.VarBinding(binding.var, self.builder_.normalize(call)))


def _join_columns(values: list):
    """[rows, n_i] values side by side -> [rows, sum n_i], as a concat of [rows, n_i / LANES, LANES]
    blocks: the fused kernel's choice of source is then the same for the LANES elements of a
    vector, which keeps it vectorized (a choice per element makes TVM write one element at a time)."""
    shapes = [_static_shape(v.ty) for v in values]
    rows = shapes[0][0]
    blocks = [relax.op.reshape(v, [rows, n // LANES, LANES]) for v, (_, n) in zip(values, shapes)]
    return relax.op.reshape(relax.op.concat(blocks, axis=1), [rows, sum(n for _, n in shapes)])


def concat_lora_gemms(mod: tvm.IRModule) -> tuple[tvm.IRModule, int]:
    """-> (module, how many projections became one GEMM)."""
    plan, bound = {}, {}
    for gv, func in mod.functions_items():
        if not (isinstance(func, relax.Function) and isinstance(func.body, relax.SeqExpr)):
            continue
        bound.update({b.var: b.value for block in func.body.blocks for b in block.bindings})
        blocks = []
        for block in func.body.blocks:
            if isinstance(block, relax.DataflowBlock):
                binds, got = _plan_block(block, bound)
                block, plan = relax.DataflowBlock(binds), {**plan, **got}
            blocks.append(block)
        mod[gv] = relax.Function(func.params, relax.SeqExpr(blocks, func.body.body), func.ret_ty,
                                 func.is_pure, func.attrs)
    if not plan:
        return mod, 0
    rewriter = _Join(mod, plan, bound)
    mod = rewrite_functions(rewriter, mod)
    mod = relax.transform.DeadCodeElimination()(mod)  # the aliases the joins skip
    return mod, rewriter.rewritten
