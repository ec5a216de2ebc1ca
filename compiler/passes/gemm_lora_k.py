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
it saves). Projections of one x (gate and up; q, k and v) share its join: both GEMMs read
[x | u_gate | u_up], against [W_gate | B_gate | 0] and [W_up | 0 | B_up] (the zeros formed in the
joining kernel), so x is copied once a forward. With LORA_K_GROUPS (core/constants.py; off: no
gain measured on an H100) a group joins where its outputs together are at least as wide as x (q/k/v:
[T, 6144] from [T, 4096] at Llama-3-8B), which also lets their backward take every du from the
input gradient's columns (gemm_lora_du.py). The sum is the same up to fp32 accumulation
order; the bf16 rounding of u B^T before the add is gone (one rounding of y instead of two).

A frozen weight that is a parameter (a bf16 base) joins too where the step reads it only as such
a projection's W or as the right operand of dY W (the input gradient): that parameter is then held
joined, [W | B | 0] of [out, in + n r] for its whole life (the runtime pads the uploaded weight
with zeros: the manifest input's `columns` is W's own width), each join writes the current B into
its slot in place (`tail_kernel`, out x r elements) and dY W reads the first `in` columns of each
row (cuBLAS takes the row length as the operand's leading dimension). The weight costs n r / in
more memory (0.8 % at Llama-3-8B's gate and up) and no copy a step.
"""
from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from lorac.core import constants
from lorac.core.constants import LORA_K_WIDE

from .gemm import GEMM_PREFIX, _static_shape
from .gemm_sum import ACC_PREFIX
from .rewrite import eliminate_dead_code, rewrite_functions, with_blocks

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
    if sx != [tokens, inp] or sb != [out, r] or r >= inp or r % LANES or inp % LANES:
        return None
    if any(str(v.ty.dtype) != "bfloat16" for v in (u, b, x, w)):
        return None
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
        inp = _static_shape(x.ty)[1]
        if not (constants.LORA_K_GROUPS and len(members) > 1 and sum(_out(binds[i]) for i, _ in members) >= inp):
            members = [(i, u) for i, u in members if _out(binds[i]) >= LORA_K_WIDE * inp]  # the wide ones
        if not members:
            continue
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


def _out(binding) -> int:
    """The output width of a planned projection's GEMM."""
    return _static_shape(binding.var.ty)[1]


def _gemm_operands(value):
    """[(operand, its layout letter)] of a lorac GEMM call (plain or accumulating), else None."""
    if not (isinstance(value, relax.Call) and value.op == _DPS):
        return None
    name = value.args[0].global_symbol
    letters = name[len(ACC_PREFIX):] if name.startswith(ACC_PREFIX) else name[len(GEMM_PREFIX):]
    if not name.startswith(GEMM_PREFIX) or set(letters) - {"n", "t"} or len(letters) % 2:
        return None
    fields = list(value.args[1].fields)
    return list(zip(fields, letters)) if len(fields) == len(letters) else None


def _resident(func: relax.Function, bound: dict, plan: dict) -> dict:
    """{parameter: (slots, its slot, r)} of the frozen weights `func` may hold joined: bf16 [out, in]
    parameters that every read takes as a planned projection's W (all with the same slots) or as
    the right operand of a GEMM that does not transpose it (dY W: its first `in` columns)."""
    params = {p for p in func.params if _static_shape(p.ty) is not None and len(_static_shape(p.ty)) == 2
              and str(p.ty.dtype) == "bfloat16"}
    slots: dict = {}
    refused = set()
    for block in func.body.blocks:
        for b in block.bindings:
            value = b.value
            if isinstance(value, relax.Var):
                continue  # an alias: its own reads are followed through _root
            operands = _gemm_operands(value)
            if operands is None:
                refused.update(r for r in (_root(bound, v) for v in relax.analysis.free_vars(value)) if r in params)
                continue
            for i, (v, letter) in enumerate(operands):
                v = _root(bound, v)
                if v not in params:
                    continue
                planned = plan.get(b.var)
                if planned is not None and i == 3:  # a planned projection's W
                    _, us, k = planned
                    slots.setdefault(v, set()).add((len(us), k, _static_shape(us[0].ty)[1]))
                elif not (i % 2 and letter == "n"):
                    refused.add(v)
    refused.update(r for r in (_root(bound, v) for v in relax.analysis.free_vars(func.body.body)) if r in params)
    return {v: next(iter(s)) for v, s in slots.items() if v not in refused and len(s) == 1}


def tail_kernel(rows: int, width: int, r: int, offset: int, dtype: str = "bfloat16", gpu: bool = True):
    """The PrimFunc writing b [rows, r] into columns [offset, offset + r) of w [rows, width], in place
    (w is the joined weight: the rest of it is left as it is). On CUDA one thread a vector of four
    columns of a row (r is a multiple of LANES), 128 threads a block; `gpu=False` is serial loops,
    for tests on the CPU."""
    from tvm.script.ir_builder import IRBuilder
    from tvm.script.ir_builder import tirx as T

    quads = r // LANES
    with IRBuilder() as ib:
        with T.prim_func():
            # scheduled here, opaque to FuseOps (as compiler/units/swiglu.py's in-place kernels)
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, "op_pattern": 8})
            w = T.arg("w", T.buffer((rows, width), dtype))
            b = T.arg("b", T.buffer((rows, r), dtype))

            def store(i, j):
                T.buffer_store(w, b[i, j], [i, offset + j])

            if not gpu:
                with T.serial(0, rows) as i:
                    with T.serial(0, r) as j:
                        store(i, j)
            else:
                threads, total = 128, rows * quads
                with T.launch_thread("blockIdx.x", -(-total // threads)) as bx, \
                        T.launch_thread("threadIdx.x", threads) as tx:
                    t = bx * threads + tx
                    with T.If(t < total):
                        with T.Then():
                            with T.vectorized(0, LANES) as v:
                                store(t // quads, t % quads * LANES + v)
    return ib.get()


@mutator
class _Join(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, plan: dict, bound: dict, resident: dict | None = None):
        super().__init__(mod)
        self.plan, self.bound, self.joined, self.rewritten = plan, bound, {}, 0
        # a parameter held joined -> its wider replacement; the tail kernels by shape
        self.held = {p: relax.Var(p.name, relax.TensorType(
            [_static_shape(p.ty)[0], _static_shape(p.ty)[1] + n * r], "bfloat16")) for p, (n, _, r) in (resident or {}).items()}
        self.kernels: dict = {}

    def visit_var_(self, var):
        return self.held.get(var, var)

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        planned = self.plan.get(binding.var)
        if planned is None:
            return super().visit_var_binding_(binding)
        x, us, k = planned
        operands = _operands(binding.value, self.bound)
        _, b, _, w = (self.visit_expr(v) for v in operands)
        key = (x, tuple(us))
        if key not in self.joined:  # [x | u_1 | ... | u_n], shared by the projections of x
            self.joined[key] = self.builder_.emit(_join_columns([self.visit_expr(v) for v in (x, *us)]))
        root = operands[3]  # W as the block binds it (_operands follows aliases)
        if root in self.held:  # a parameter held joined: B written into its slot, in place
            wb = self._write_tail(self.held[root], b, _static_shape(root.ty)[1] + k * _static_shape(b.ty)[1])
        else:
            # zeros against the other projections' u (their ranks are this one's: _plan_block), formed in
            # the joining kernel as B * 0: a zeros op would be folded into a constant block stored with
            # the artifact, one per projection and layer
            zero = self.builder_.normalize(relax.op.multiply(b, relax.const(0.0, "bfloat16")))
            wb = self.builder_.emit(_join_columns([w] + [b if i == k else zero for i in range(len(us))]))
        self.rewritten += 1
        call = relax.call_dps_packed(GEMM_PREFIX + "nt", [self.joined[key], wb], binding.value.ty)
        self.builder_.emit_normalized(relax.VarBinding(binding.var, self.builder_.normalize(call)))

    def _write_tail(self, held: relax.Var, b, offset: int):
        (rows, width), r = _static_shape(held.ty), _static_shape(b.ty)[1]
        key = (rows, width, r, offset)
        if key not in self.kernels:
            self.kernels[key] = self.builder_.add_func(tail_kernel(rows, width, r, offset), "lorac_lora_tail")
        return self.builder_.emit(relax.call_tir_inplace(self.kernels[key], [held, b], [0], held.ty))


def _join_columns(values: list):
    """[rows, n_i] values side by side -> [rows, sum n_i], as a concat of [rows, n_i / LANES, LANES]
    blocks: the fused kernel's choice of source is then the same for the LANES elements of a
    vector, which keeps it vectorized (a choice per element makes TVM write one element at a time)."""
    shapes = [_static_shape(v.ty) for v in values]
    rows = shapes[0][0]
    blocks = [relax.op.reshape(v, [rows, n // LANES, LANES]) for v, (_, n) in zip(values, shapes)]
    return relax.op.reshape(relax.op.concat(blocks, axis=1), [rows, sum(n for _, n in shapes)])


def concat_lora_gemms(mod: tvm.IRModule) -> tuple[tvm.IRModule, int, dict]:
    """-> (module, how many projections became one GEMM, {name of a parameter held joined: (its own
    width, slots, r, its slot)}: the manifest's `columns` and gemm_lora_du.py's slots)."""
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
        mod[gv] = with_blocks(func, blocks)
    main = mod["main"] if "main" in [gv.name_hint for gv in mod.get_global_vars()] else None
    resident = _resident(main, bound, plan) if isinstance(main, relax.Function) else {}
    # a projection over a parameter not held joined keeps its accumulating pair (a join would copy
    # W every step)
    weight = lambda v: _operands(bound[v], bound)[3]  # noqa: E731 (W of a planned projection, aliases followed)
    plan = {v: p for v, p in plan.items() if not _from_parameter(bound, weight(v)) or weight(v) in resident}
    if not plan:
        return mod, 0, {}
    rewriter = _Join(mod, plan, bound, resident)
    mod = rewrite_functions(rewriter, mod)
    if rewriter.held:
        func = mod["main"]
        params = [rewriter.held.get(p, p) for p in func.params]
        mod["main"] = relax.Function(params, func.body, func.ret_ty, func.is_pure, func.attrs)
    mod = eliminate_dead_code(mod)  # the aliases the joins skip
    slots = {new.name: (_static_shape(p.ty)[1], n, r, k) for p, new in rewriter.held.items() for n, k, r in [resident[p]]}
    return mod, rewriter.rewritten, slots
