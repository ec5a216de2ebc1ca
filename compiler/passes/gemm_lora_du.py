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
slots, each slot once), each with a du GEMM of the same dy against the B written into its slot.
"""
from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from .gemm import GEMM_PREFIX, _static_shape
from .gemm_sum import ACC_PREFIX
from .rewrite import rewrite_functions

_DPS = tvm.ir.Op.get("relax.call_dps_packed")
_INPLACE = tvm.ir.Op.get("relax.call_tir_inplace")
_ASTYPE = tvm.ir.Op.get("relax.astype")


def _root(bound: dict, v):
    while isinstance(v, relax.Var) and isinstance(bound.get(v), relax.Var):
        v = bound[v]
    return v


def _gemm(value):
    """(letters, [operands]) of a lorac GEMM call (plain or accumulating), else None."""
    if not (isinstance(value, relax.Call) and value.op == _DPS):
        return None
    name = value.args[0].global_symbol
    if not name.startswith(GEMM_PREFIX):
        return None
    letters = name[len(ACC_PREFIX):] if name.startswith(ACC_PREFIX) else name[len(GEMM_PREFIX):]
    fields = list(value.args[1].fields)
    if set(letters) - {"n", "t"} or len(letters) != len(fields):
        return None
    return letters, fields


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


def _plan(block, bound: dict, held: dict) -> tuple[dict, dict, dict]:
    """-> ({du var: (group, slot)}, {input-gradient var: (group, its other terms)}, {group: (first
    du var, [(dy, held weight)], in, joined width, r, output dtype)}); a group is keyed by its
    input-gradient var."""
    slots = _slots(block, bound, held)
    pos = {b.var: i for i, b in enumerate(block.bindings)}
    du_of: dict = {}  # (dy, B) -> the var of dy B
    for b in block.bindings:
        g = _gemm(b.value)
        if g is not None and g[0] == "nn":
            du_of[(_root(bound, g[1][0]), _root(bound, g[1][1]))] = b.var
    dus, accs, groups = {}, {}, {}
    for b in block.bindings:
        g = _gemm(b.value)
        if g is None or not b.value.args[0].global_symbol.startswith(ACC_PREFIX):
            continue
        letters, fields = g
        pairs = [(fields[i], fields[i + 1], letters[i:i + 2]) for i in range(0, len(fields), 2)]
        is_held = [lay == "nn" and _root(bound, w) in held for _, w, lay in pairs]
        frozen = [(dy, w) for (dy, w, _), h in zip(pairs, is_held) if h]
        rest = [t for t, h in zip(pairs, is_held) if not h]
        ws = [_root(bound, w) for _, w in frozen]
        infos = {held[w][:3] for w in ws}
        if not frozen or len(infos) != 1:
            continue
        inp, n, r = next(iter(infos))
        found = []
        for (dy, _), w in zip(frozen, ws):
            du = [du_of[(_root(bound, dy), bv)] for bv in slots.get(w, ()) if (_root(bound, dy), bv) in du_of]
            if len(du) != 1 or du[0] in dus:
                break
            found.append((du[0], held[w][3]))
        if len(found) != len(frozen) or len({k for _, k in found}) != len(found):
            continue
        first = min((du for du, _ in found), key=pos.__getitem__)
        # the joined GEMM stands where the first du GEMM did: every dy must be bound before it
        if any(pos.get(_root(bound, dy), -1) >= pos[first] for dy, _ in frozen):
            continue
        for du, k in found:
            dus[du] = (b.var, k)
        accs[b.var] = (b.var, rest)
        groups[b.var] = (first, frozen, inp, inp + n * r, r, str(b.value.ty.dtype))
    return dus, accs, groups


@mutator
class _Columns(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, dus: dict, accs: dict, groups: dict):
        super().__init__(mod)
        self.dus, self.accs, self.groups, self.big, self.names = dus, accs, groups, {}, set()
        self.rewritten = 0

    def _call(self, terms: list, ty):
        """One GEMM over (a, b, layout) terms: plain for one, accumulating for several."""
        name = (ACC_PREFIX if len(terms) > 1 else GEMM_PREFIX) + "".join(lay for _, _, lay in terms)
        if len(terms) > 1:
            self.names.add(name)
        args = [self.visit_expr(v) for a, b, _ in terms for v in (a, b)]
        return self.builder_.emit(relax.call_dps_packed(name, args, ty))

    def _big(self, key):
        if key not in self.big:
            _, frozen, _, width, _, dtype = self.groups[key]
            rows = _static_shape(frozen[0][0].ty)[0]
            self.big[key] = self._call([(dy, w, "nn") for dy, w in frozen], relax.TensorType([rows, width], dtype))
        return self.big[key]

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        var = binding.var
        if var in self.dus:  # du_k: the columns of slot k
            key, k = self.dus[var]
            inp, r = self.groups[key][2], self.groups[key][4]
            du = relax.op.strided_slice(self._big(key), [1], [inp + k * r], [inp + (k + 1) * r])
            value = relax.op.astype(du, binding.value.ty.dtype)
        elif var in self.accs:  # dx: the first `in` columns, plus the other terms (du A) summed in fp32
            key, rest = self.accs[var]
            head = relax.op.strided_slice(self._big(key), [1], [0], [self.groups[key][2]])
            if rest:
                other = self._call(rest, binding.value.ty)
                value = relax.op.astype(relax.op.add(relax.op.astype(head, "float32"),
                                                     relax.op.astype(other, "float32")), binding.value.ty.dtype)
            else:
                value = head
            self.rewritten += 1
        else:
            return super().visit_var_binding_(binding)
        self.builder_.emit_normalized(relax.VarBinding(var, self.builder_.normalize(value)))


def lora_du_columns(mod: tvm.IRModule, held: dict) -> tuple[tvm.IRModule, int, list[str]]:
    """`held`: {main's parameter var held joined: (in, n slots, r, its own slot)}.
    -> (module, input-gradient GEMMs that now also write du, accumulating names it added)."""
    if not held or "main" not in [gv.name_hint for gv in mod.get_global_vars()]:
        return mod, 0, []
    func = mod["main"]
    if not isinstance(func.body, relax.SeqExpr):
        return mod, 0, []
    bound = {b.var: b.value for block in func.body.blocks for b in block.bindings}
    dus, accs, groups = {}, {}, {}
    for block in func.body.blocks:
        if isinstance(block, relax.DataflowBlock):
            for into, got in zip((dus, accs, groups), _plan(block, bound, held)):
                into.update(got)
    if not accs:
        return mod, 0, []
    rewriter = _Columns(mod, dus, accs, groups)
    mod = rewrite_functions(rewriter, mod)
    mod = relax.transform.DeadCodeElimination()(mod)
    return mod, rewriter.rewritten, sorted(rewriter.names)
