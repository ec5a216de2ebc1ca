"""The LoRA du of weights held joined, as extra columns of the input gradient's GEMM.

A frozen weight held joined (gemm_lora_k.py) is [W | B_1 | ... | B_n] per row, each projection's
B in its own slot and zeros in the others' ([W_gate | B_gate | 0], [W_up | 0 | B_up]). The
backward reads W alone for dx = sum_i dy_i W_i (an accumulating GEMM over the first `in` columns)
and B again for each du_i = dy_i B_i, a rank-r GEMM that reads the whole dy_i once more: at
Llama-3-8B's 8192 tokens, dy_gate and dy_up are [8192, 14336] and those two thin GEMMs take
0.19 ms a layer on an H100. Over the whole rows, the same sum gives both:

    sum_i dy_i [W_i | slots_i] = [sum_i dy_i W_i | dy_1 B_1 | ... | dy_n B_n]

(each dy_i meets B_i in its own slot and zeros elsewhere), so one GEMM [N, in + n r] writes dx's
frozen part and every du_i, and the thin GEMMs go. The input gradient's other terms (the LoRA
term du A, which needs du first) become their own GEMM, added to the first `in` columns where
the sum is read. du now comes out of a bf16 output (it was an fp32 one that the graph rounds to
bf16 right after scaling it by s): one rounding more on a value rounded anyway.

Applies where every frozen term of an accumulating call is a held weight of one join (the same
slots, each slot once), each with a du GEMM of the same dy against the B written into its slot; and
where they are weights computed in the step (dequantized: NF4, int8, GGUF), each with one du GEMM of
its dy, at least two of them and together at least as wide as their input (q/k/v, gate/up): those
are joined with their B here, [W_k | 0 | B_k | 0], in the kernel that dequantizes them. That second
form is off by default (JOIN_DEQUANTIZED): its rewrite is proven on the CPU
(tests/test_compiler_gpu_passes.py), but on an H100 it made the NF4 Llama-3-8B 4x2048 step slower
(587.0 against 579.5 ms: the dequantization writes the wider rows at every forward, backward and
recompute; docs/BENCHMARKS.md).
"""
from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from .gemm import GEMM_PREFIX, _static_shape
from .gemm_lora_k import _from_parameter, _gemm_operands, _join_columns, _root
from .gemm_sum import ACC_PREFIX
from .rewrite import eliminate_dead_code, rewrite_functions

JOIN_DEQUANTIZED = False  # weights dequantized in the step too (see above); off: slower as measured
_DPS = tvm.ir.Op.get("relax.call_dps_packed")
_INPLACE = tvm.ir.Op.get("relax.call_tir_inplace")


def _name(value) -> str:
    return value.args[0].global_symbol if isinstance(value, relax.Call) and value.op == _DPS else ""


def _slots(block, bound: dict, held: dict) -> dict:
    """{held weight: the B values written into its slot} from the tail kernels' in-place writes
    (the forward's join and a recomputed layer's write the same B)."""
    out: dict = {}
    for b in block.bindings:
        v = b.value
        if isinstance(v, relax.Call) and v.op == _INPLACE:
            args = list(v.args[1].fields)
            w = _root(bound, args[0])
            if w in held and len(args) == 2:
                out.setdefault(w, set()).add(_root(bound, args[1]))
    return out


def _computed(bound: dict, w) -> bool:
    """Whether w is computed in the step (a dequantization), not a parameter or a view of one: its
    join is then free (FuseOps writes the wider rows in the kernel that makes w); a parameter's
    would copy it every step."""
    return w in bound and not _from_parameter(bound, w)


def _plan(block, bound: dict, held: dict, dequantized: bool) -> tuple[dict, dict]:
    """-> ({du var: group}, {input-gradient var: group}); a group is a dict: `frozen` [(dy, W, slot,
    B or None)] (B: the weight is joined here, None: held joined), `rest` (the call's other
    terms), `inp`, `width`, `r`, `dtype`, `after` (the binding after which the joined GEMM and the
    du columns are emitted, None: before the first du GEMM), `dus` [(du var, slot)]."""
    slots = _slots(block, bound, held)
    binds = list(block.bindings)
    pos = {b.var: i for i, b in enumerate(binds)}
    first_use: dict = {}
    for i, b in enumerate(binds):
        for v in relax.analysis.free_vars(b.value):
            first_use.setdefault(v, i)
    du_of: dict = {}  # dy -> [(B, the var of dy B)]
    for b in binds:
        if _name(b.value) == GEMM_PREFIX + "nn":
            dy, bv = b.value.args[1].fields
            du_of.setdefault(_root(bound, dy), []).append((_root(bound, bv), b.var))
    dus, accs = {}, {}
    for b in binds:
        ops = _gemm_operands(b.value) if _name(b.value).startswith(ACC_PREFIX) else None
        if ops is None:
            continue
        # roots: the joined GEMM may stand before the aliases the call reads them through
        pairs = [(_root(bound, a), _root(bound, c), la + lc) for (a, la), (c, lc) in zip(ops[::2], ops[1::2])]
        kind = ["held" if lay == "nn" and w in held else
                # a computed weight whose dy also meets a B (its LoRA term's A is computed too, a concat)
                "join" if dequantized and lay == "nn" and _computed(bound, w) and dy in du_of else None
                for dy, w, lay in pairs]
        frozen = [(dy, w) for (dy, w, _), k in zip(pairs, kind) if k]
        rest = [t for t, k in zip(pairs, kind) if not k]
        kinds = {k for k in kind if k}
        if len(kinds) != 1:
            continue
        group = _held_group(frozen, held, slots, du_of) if kinds == {"held"} else _joined_group(frozen, du_of)
        if group is None or any(du in dus for du, _ in group["dus"]):
            continue
        # the joined GEMM goes right after the last of its inputs is bound, and every du must be read
        # only after that
        last = max((pos.get(v, -1) for t in group["frozen"] for v in t[:2] + t[3:] if v is not None), default=-1)
        first = min(pos[du] for du, _ in group["dus"])
        if any(first_use.get(du, len(binds)) <= max(last, first - 1) for du, _ in group["dus"]):
            continue
        group.update(rest=rest, dtype=str(b.value.ty.dtype), after=binds[last].var if last >= first else None)
        for du, _ in group["dus"]:
            dus[du] = group
        accs[b.var] = group
    return dus, accs


def _held_group(frozen, held, slots, du_of):
    """Weights held joined: each slot's B is what the tail kernels write into it. (`frozen`: roots.)"""
    infos = {held[w][:3] for _, w in frozen}
    if len(infos) != 1:
        return None
    inp, n, r = next(iter(infos))
    found = []
    for dy, w in frozen:
        du = [v for bv, v in du_of.get(dy, ()) if bv in slots.get(w, ())]
        if len(du) != 1:
            return None
        found.append((du[0], held[w][3]))
    if len({k for _, k in found}) != len(found):
        return None
    return {"frozen": [(dy, w, k, None) for (dy, w), (_, k) in zip(frozen, found)], "dus": found,
            "inp": inp, "width": inp + n * r, "r": r}


def _joined_group(frozen, du_of):
    """Weights computed in the step (dequantized): joined here with their B ([W_k | 0 | B_k | 0], slot
    k the term's place), where several share the call (q/k/v, gate/up: a single projection's sum
    would be added to its LoRA term by a kernel of its own) and together are at least as wide as
    their input (down_proj's [N, 14336] input gradient would be copied out of the wider output)."""
    if len(frozen) < 2:
        return None
    shapes = [_static_shape(w.ty) for _, w in frozen]
    inp = shapes[0][1]
    if any(sh is None or sh[1] != inp for sh in shapes) or sum(sh[0] for sh in shapes) < inp:
        return None
    out, found = [], []
    for k, ((dy, w), (rows, _)) in enumerate(zip(frozen, shapes)):
        cands = [(bv, v) for bv, v in du_of.get(dy, ())
                 if _static_shape(bv.ty) is not None and _static_shape(bv.ty)[0] == rows]
        if len(cands) != 1:
            return None
        b, du = cands[0]
        out.append((dy, w, k, b))
        found.append((du, k))
    rs = {_static_shape(b.ty)[1] for *_, b in out}
    if len(rs) != 1 or any(str(b.ty.dtype) != str(w.ty.dtype) for _, w, _, b in out):
        return None
    r = rs.pop()
    return {"frozen": out, "dus": found, "inp": inp, "width": inp + len(out) * r, "r": r}


@mutator
class _Columns(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, dus: dict, accs: dict):
        super().__init__(mod)
        self.dus, self.accs, self.names = dus, accs, set()
        self.after: dict = {}  # a binding's var -> the groups emitted right after it
        for g in accs.values():
            if g["after"] is not None:
                self.after.setdefault(g["after"], []).append(g)
        self.rewritten = 0

    def _gemm(self, terms: list, ty):
        """One GEMM call over (a, b, layout) terms: plain for one, accumulating for several."""
        name = (ACC_PREFIX if len(terms) > 1 else GEMM_PREFIX) + "".join(lay for *_, lay in terms)
        if len(terms) > 1:
            self.names.add(name)
        return self.builder_.emit(relax.call_dps_packed(name, [v for a, b, _ in terms for v in (a, b)], ty))

    def _emit_group(self, g: dict) -> None:
        """The joined GEMM [N, in + n r] (g["big"]) and each du as its columns."""
        if "big" in g:
            return
        terms = []
        for dy, w, k, b in g["frozen"]:
            w = self.visit_expr(w)
            if b is not None:  # [W | slots], B in slot k and zeros (B * 0, formed in the joining kernel)
                b = self.visit_expr(b)
                zero = self.builder_.normalize(relax.op.multiply(b, relax.const(0.0, str(b.ty.dtype))))
                w = self.builder_.emit(_join_columns([w] + [b if i == k else zero for i in range(len(g["frozen"]))]))
            terms.append((self.visit_expr(dy), w, "nn"))
        rows = _static_shape(terms[0][0].ty)[0]
        g["big"] = self._gemm(terms, relax.TensorType([rows, g["width"]], g["dtype"]))
        for du, k in g["dus"]:
            cols = relax.op.strided_slice(g["big"], [1], [g["inp"] + k * g["r"]], [g["inp"] + (k + 1) * g["r"]])
            value = relax.op.astype(cols, du.ty.dtype)
            self.builder_.emit_normalized(relax.VarBinding(du, self.builder_.normalize(value)))

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        self._rewrite(binding)
        for g in self.after.get(binding.var, ()):
            self._emit_group(g)

    def _rewrite(self, binding: relax.VarBinding) -> None:
        var = binding.var
        if var in self.dus:  # emitted with its group (here, or after the group's last input)
            g = self.dus[var]
            if g["after"] is None:
                self._emit_group(g)
            return
        if var in self.accs:  # dx: the first `in` columns, plus the other terms (du A) summed in fp32
            g = self.accs[var]
            head = relax.op.strided_slice(g["big"], [1], [0], [g["inp"]])
            if g["rest"]:
                other = self._gemm([(self.visit_expr(a), self.visit_expr(b), lay) for a, b, lay in g["rest"]],
                                   binding.value.ty)
                dtype = binding.value.ty.dtype
                value = relax.op.astype(relax.op.add(relax.op.astype(head, "float32"),
                                                     relax.op.astype(other, "float32")), dtype)
            else:
                value = head
            self.rewritten += 1
            self.builder_.emit_normalized(relax.VarBinding(var, self.builder_.normalize(value)))
            return
        super().visit_var_binding_(binding)


def lora_du_columns(mod: tvm.IRModule, slots: dict, dequantized: bool = JOIN_DEQUANTIZED
                    ) -> tuple[tvm.IRModule, int, list[str]]:
    """`slots`: {name of a parameter of main held joined: (in, n slots, r, its own slot)}
    (gemm_lora_k.concat_lora_gemms).
    -> (module, input-gradient GEMMs that now also write du, accumulating names it added)."""
    if "main" not in [gv.name_hint for gv in mod.get_global_vars()]:
        return mod, 0, []
    func = mod["main"]
    if not isinstance(func.body, relax.SeqExpr):
        return mod, 0, []
    held = {p: slots[p.name] for p in func.params if p.name in slots}
    bound = {b.var: b.value for block in func.body.blocks for b in block.bindings}
    dus, accs = {}, {}
    for block in func.body.blocks:
        if isinstance(block, relax.DataflowBlock):
            d, a = _plan(block, bound, held, dequantized)
            dus.update(d)
            accs.update(a)
    if not accs:
        return mod, 0, []
    rewriter = _Columns(mod, dus, accs)
    mod = rewrite_functions(rewriter, mod)
    mod = eliminate_dead_code(mod)
    return mod, rewriter.rewritten, sorted(rewriter.names)
