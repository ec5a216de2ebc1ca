"""bf16 GEMM outputs: activations leave the vendor GEMM in bfloat16, weight gradients in fp32.

After dispatch (gemm.py) and sum fusion (gemm_sum.py) every bf16 build's GEMM still wrote
fp32: each [tokens, features] result was written at 4 bytes an element and read back at 4
by every kernel after it, and the accumulating LoRA chains (beta = 1) read and wrote fp32
blocks. Here a GEMM whose reduction is not its largest dimension (K <= max(M, N): a
projection, the logits, an input gradient) writes bf16 instead, as autocast-style training
stores activations; cuBLAS still accumulates in fp32. Every reader gets its own widening
cast, which fuses into the reader's kernel (one shared cast would be a kernel of its own
writing an fp32 copy), and a GEMM reading the result takes the bf16 value directly. A GEMM
that reduces over more elements than it writes (K > max(M, N): the LoRA weight gradients,
dA = du^T x and dB = dy^T u, summed over every token) keeps its fp32 output, as do the
function's outputs. Softmax, norms, residual adds and the loss still compute in fp32
inside their kernels.
"""
from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from .gemm import GEMM_PREFIX, _static_shape
from .rewrite import dataflow_blocks, eliminate_dead_code, rewrite_functions

_DPS = tvm.ir.Op.get("relax.call_dps_packed")
_ASTYPE = tvm.ir.Op.get("relax.astype")
_RESHAPE = tvm.ir.Op.get("relax.reshape")
_GATHERS = (tvm.ir.Op.get("relax.gather_elements"), tvm.ir.Op.get("relax.take"))


def gemm_dims(name: str, args: list) -> tuple[int, int, int] | None:
    """(M, N, K) of a `lorac.gemm_<ta><tb>` or `lorac.gemm_acc_...` call (its first pair)."""
    letters = name[len(GEMM_PREFIX):].removeprefix("acc_")[:2]
    sa, sb = _static_shape(args[0].ty), _static_shape(args[1].ty)
    if sa is None or sb is None or len(letters) != 2:
        return None
    m, k = (sa[-1], sa[-2]) if letters[0] == "t" else (sa[-2], sa[-1])
    n = sb[-2] if letters[1] == "t" else sb[-1]
    return m, n, k


def _narrowable(value, dtype: str) -> bool:
    if not (isinstance(value, relax.Call) and value.op == _DPS and isinstance(value.ty, relax.TensorType)
            and str(value.ty.dtype) == "float32"):
        return False
    name = value.args[0].global_symbol
    if not name.startswith(GEMM_PREFIX):
        return False
    args = list(value.args[1].fields)
    if any(str(a.ty.dtype) != dtype for a in args):
        return False
    dims = gemm_dims(name, args)
    return dims is not None and dims[2] <= max(dims[0], dims[1])


@mutator
class _NarrowOutputs(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, dtype: str, narrow: set):
        super().__init__(mod)
        self.dtype = dtype
        self.narrow = narrow  # the dataflow vars whose values are stored in `dtype`
        self.low = {}  # old fp32 var -> the bf16 var that replaces it
        self.count = 0

    def visit_var_binding_(self, binding):
        value = binding.value
        if (isinstance(binding.var, relax.DataflowVar) and isinstance(value, relax.Call) and value.op == _RESHAPE
                and value.args[0] in self.low):
            # a reshape of a narrowed result reshapes the bf16 value (a view): widened as
            # one binding it would be a kernel writing an fp32 copy for all its readers
            self.low[binding.var] = self.builder_.emit(relax.op.reshape(self.low[value.args[0]], value.args[1]))
            return None
        if binding.var not in self.narrow:
            return super().visit_var_binding_(binding)
        call = self.visit_expr(binding.value)
        if call.op == _DPS:  # a vendor GEMM writes `dtype` itself
            low = self.builder_.emit(relax.call_dps_packed(call.args[0], call.args[1],
                                                           relax.TensorType(call.ty.shape, self.dtype)))
        elif call.op == _ASTYPE and str(call.args[0].ty.dtype) == self.dtype:  # a widening: its source
            low = call.args[0]
        else:  # a TVM kernel: the narrowing fuses into it
            low = self.builder_.emit(relax.op.astype(self.builder_.emit(call), self.dtype))
        self.low[binding.var] = low
        self.count += 1
        return None

    def visit_dataflow_var_(self, var):
        low = self.low.get(var)
        return var if low is None else relax.op.astype(low, "float32")  # one widening per reader

    def visit_call_(self, call):
        """A narrowing of a widened result (a GEMM reading another's output), also through a
        reshape, reads the bf16 result itself; a gather from a widened result gathers from
        the bf16 result and widens the rows it took (TVM does not fuse a cast into a gather:
        the loss's pick of the target logits wrote an fp32 copy of every [2048, 151936]
        chunk, 1.1 ms each on the H200)."""
        call = super().visit_call_(call)
        if call.op in _GATHERS:
            src = call.args[0]
            if isinstance(src, relax.Var):
                src = self.lookup_binding(src)
            if isinstance(src, relax.Call) and src.op == _ASTYPE and str(src.args[0].ty.dtype) == self.dtype:
                picked = self.builder_.emit(relax.Call(call.op, [src.args[0], *call.args[1:]], call.attrs))
                return relax.op.astype(picked, "float32")
            return call
        if call.op != _ASTYPE or str(call.attrs.dtype) != self.dtype:
            return call
        src = call.args[0]
        if isinstance(src, relax.Var):
            src = self.lookup_binding(src)
        if isinstance(src, relax.Call) and src.op == _RESHAPE:
            inner = src.args[0]
            if isinstance(inner, relax.Call) and inner.op == _ASTYPE and str(inner.args[0].ty.dtype) == self.dtype:
                return relax.op.reshape(inner.args[0], src.args[1])
        if isinstance(src, relax.Call) and src.op == _ASTYPE and str(src.args[0].ty.dtype) == self.dtype:
            return src.args[0]
        return call


def narrow_values(mod: tvm.IRModule, narrow: set, dtype: str = "bfloat16") -> tuple[tvm.IRModule, int]:
    """Store the values of the dataflow vars in `narrow` (each bound to a vendor GEMM's call or
    an elementwise fp32 result) in `dtype`, each reader widening its own copy as above.
    -> (module, number of values narrowed)."""
    if not narrow:
        return mod, 0
    rw = _NarrowOutputs(mod, dtype, narrow)
    mod = rewrite_functions(rw, mod)
    # the widenings that gathers and GEMMs no longer read
    return eliminate_dead_code(relax.transform.Normalize()(mod)), rw.count


def narrow_gemm_outputs(mod: tvm.IRModule, dtype: str = "bfloat16") -> tuple[tvm.IRModule, int]:
    """-> (module, number of GEMMs that now write `dtype`)."""
    narrow = set()  # dataflow vars bound to a narrowable GEMM, read only in the block
    for block in dataflow_blocks(mod):
        values = {b.var: b.value for b in block.bindings}
        narrow |= {var for var in relax.analysis.udchain(block)
                   if isinstance(var, relax.DataflowVar) and _narrowable(values.get(var), dtype)}
    return narrow_values(mod, narrow, dtype)
