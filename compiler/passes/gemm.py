"""GEMM dispatch: every Relax matmul becomes a call to a runtime-registered vendor GEMM.

TVM's untuned matmul kernels run 317x slower than BLAS on the host CPU and ~19x slower
than cuBLAS on the H200 (NOTES.md), so no matmul is left to TVM. Each `R.matmul(a, b)` is
replaced by `call_dps_packed("lorac.gemm_<ta><tb>", [a', b'])`, where a transpose of the
last two axes feeding an operand (`R.permute_dims(w, [.., -1, -2])`, e.g. HF [out, in]
weights or K^T in attention) is folded into the call as an `n`/`t` letter in the name:
the library reads the operand transposed in place, and a permute that only matmuls read is
never emitted.

The runtime registers the four functions `lorac.gemm_nn`, `_nt`, `_tn`, `_tt` (runtime/engine/gemm.py,
which hands each call to its device's library: runtime/devices/cpu/gemm.py, runtime/devices/cuda/gemm.py)
with the contract

    out[..., M, N] = op_a(a)[..., M, K] @ op_b(b)[..., K, N]     (op = identity or swap of the last two axes)

where `a` and `b` are row-major (contiguous), have 2 dims or the same batch dims as
`out`, and `out` is written in full (sums of GEMMs that accumulate into one output are
gemm_sum.py's `lorac.gemm_acc_*` calls).

With `compute_dtype="bfloat16"`, every GEMM gets both operands in bf16 and writes fp32:
the library multiplies in bf16 and accumulates in fp32 (autocast-style). A weight widened
from bf16 is used as the bf16 original, also through a reshape (the fused attention's
bf16 output feeding o_proj); an activation is narrowed once, by a cast that fuses into
its producer; the fp32 LoRA masters are narrowed per step (a few KB). The thin rank-r
LoRA GEMMs go to bf16 tensor cores too: in fp32 they were 66 ms of a 276 ms Qwen3-0.6B
step on the H200 (docs/BENCHMARKS.md), and the gradients they feed are accumulated in
fp32 and checked against the fp32 reference (cosine >= 0.999).
"""
from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from .rewrite import dataflow_blocks, eliminate_dead_code, rewrite_functions

GEMM_PREFIX = "lorac.gemm_"
GEMM_NAMES = tuple(GEMM_PREFIX + a + b for a in "nt" for b in "nt")

_MATMUL = tvm.ir.Op.get("relax.matmul")
_PERMUTE = tvm.ir.Op.get("relax.permute_dims")
_ASTYPE = tvm.ir.Op.get("relax.astype")
_RESHAPE = tvm.ir.Op.get("relax.reshape")


def _static_shape(ty) -> list[int] | None:
    """The static shape of a tensor type, or None when a dim is symbolic or unknown."""
    if not isinstance(ty, relax.TensorType) or ty.shape is None:
        return None
    if not isinstance(ty.shape, relax.ShapeExpr):
        return None
    dims = []
    for d in ty.shape.values:
        if not isinstance(d, tvm.tirx.IntImm):
            return None
        dims.append(int(d))
    return dims


def _swaps_last_two(axes, ndim: int) -> bool:
    if axes is None:  # permute_dims with no axes reverses them: a swap only for 2-D
        return ndim == 2
    perm = [int(a) for a in axes]
    return ndim >= 2 and perm == list(range(ndim - 2)) + [ndim - 1, ndim - 2]


@mutator
class _GemmRewriter(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, compute_dtype: str):
        super().__init__(mod)
        self.compute_dtype = compute_dtype
        self.rewritten = 0
        self.left = []  # matmuls kept as TVM kernels, with the reason
        self.narrowed = {}  # activation -> its bf16 cast, so each is cast once
        self.foldable = _matmul_only_transposes(mod)
        self.deferred = {}  # a foldable transpose's var -> its (visited) call, not emitted
        self.emitted = {}  # ... -> its var, where a matmul needed it after all

    def visit_var_binding_(self, binding):
        """Hold back a transpose that only matmuls read: folded into each of them, it is
        never emitted, so no dead-code pass is needed after the rewrite (that pass alone
        took 0.6 s of a Qwen3-0.6B compile)."""
        if binding.var in self.foldable:
            self.deferred[binding.var] = self.visit_expr(binding.value)
            return None
        return super().visit_var_binding_(binding)

    def _materialize(self, operand):
        """A held-back transpose that a matmul left to TVM reads after all: emit it once."""
        if operand in self.deferred:
            self.emitted[operand] = self.builder_.emit(self.deferred.pop(operand))
        return self.emitted.get(operand, operand)

    def _producer(self, expr):
        """The call that bound `expr`, looking through plain variables."""
        if expr in self.deferred:
            return self.deferred[expr]
        if isinstance(expr, relax.Var):
            bound = self.lookup_binding(expr)
            if isinstance(bound, relax.Call):
                return bound
        return None

    def _fold_transpose(self, operand):
        """(source, transposed?) for a matmul operand, folding a last-two-axes permute."""
        call = self._producer(operand)
        if call is not None and call.op == _PERMUTE:
            src = call.args[0]
            shape = _static_shape(src.ty)
            if shape is not None and _swaps_last_two(call.attrs.axes, len(shape)):
                return src, True
        return operand, False

    def _narrow_source(self, operand):
        """The bf16 original of an operand that is a widened bf16 value (or a reshape of
        one, emitted here on the original), else None."""
        if operand.ty.dtype == self.compute_dtype:
            return operand
        call = self._producer(operand)
        if call is not None and call.op == _ASTYPE and call.args[0].ty.dtype == self.compute_dtype:
            return call.args[0]
        if call is not None and call.op == _RESHAPE:
            inner = self._narrow_source(call.args[0])
            if inner is not None:
                return self.builder_.emit(relax.op.reshape(inner, call.args[1]))
        return None

    def _to_compute_dtype(self, operand):
        if operand not in self.narrowed:
            src = self._narrow_source(operand)
            self.narrowed[operand] = src if src is not None else self.builder_.emit(
                relax.op.astype(operand, self.compute_dtype))
        return self.narrowed[operand]

    def visit_call_(self, call: relax.Call):
        call = super().visit_call_(call)
        if call.op != _MATMUL:
            return call
        a, b = call.args
        out_shape = _static_shape(call.ty)
        sa, sb = _static_shape(a.ty), _static_shape(b.ty)
        why = None
        if out_shape is None or sa is None or sb is None:
            why = "symbolic shape"
        elif len(sa) < 2 or len(sb) < 2:
            why = "1-D operand"
        elif call.ty.dtype not in ("float32", "bfloat16"):
            why = f"dtype {call.ty.dtype}"
        elif not (len(sa) == 2 or sa[:-2] == out_shape[:-2]) or not (len(sb) == 2 or sb[:-2] == out_shape[:-2]):
            why = "broadcast batch dims"
        if why is not None:
            self.left.append(f"{sa} x {sb}: {why}")
            return relax.Call(call.op, [self._materialize(x) for x in call.args], call.attrs, call.ty_args)
        (a, ta), (b, tb) = self._fold_transpose(a), self._fold_transpose(b)
        a, b = self._materialize(a), self._materialize(b)  # held back but not foldable here
        if self.compute_dtype != "float32":
            a, b = self._to_compute_dtype(a), self._to_compute_dtype(b)
        name = GEMM_PREFIX + ("t" if ta else "n") + ("t" if tb else "n")
        self.rewritten += 1
        out_ty = relax.TensorType(out_shape, "float32" if self.compute_dtype != "float32" else call.ty.dtype)
        return relax.call_dps_packed(name, [a, b], out_ty)


def _matmul_only_transposes(mod: tvm.IRModule) -> set:
    """Dataflow variables bound to a last-two-axes transpose whose every reader is a matmul."""
    out = set()
    for block in dataflow_blocks(mod):
        values = {b.var: b.value for b in block.bindings}
        for var, users in relax.analysis.udchain(block).items():
            call = values.get(var)
            if (isinstance(var, relax.DataflowVar) and isinstance(call, relax.Call) and call.op == _PERMUTE
                    and len(users) > 0
                    and all(isinstance(values.get(u), relax.Call) and values[u].op == _MATMUL for u in users)):
                shape = _static_shape(call.args[0].ty)
                if shape is not None and _swaps_last_two(call.attrs.axes, len(shape)):
                    out.add(var)
    return out


def dispatch_gemms(mod: tvm.IRModule, compute_dtype: str = "float32") -> tuple[tvm.IRModule, int, list[str]]:
    """Rewrite every static-shape float matmul to a lorac GEMM call.

    Returns (module, number rewritten, descriptions of matmuls left to TVM). Run it on the
    imported module before legalization.
    """
    rw = _GemmRewriter(mod, compute_dtype)
    mod = rewrite_functions(rw, mod)
    if compute_dtype != "float32":  # the fp32 widenings of bf16 weights that only GEMMs read
        mod = eliminate_dead_code(mod)
    return mod, rw.rewritten, rw.left
