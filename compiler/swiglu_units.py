"""SwiGLU's backward units on CUDA bf16, mapped whole to one kernel each (graphs/mlp.py).

    SwiGLUGrad(da, gate, up)     -> dgate, dup
    SwiGLUGradAct(da, gate, up)  -> dgate, dup, act = silu(gate) * up

Inlined, each result is a TVM kernel of its own that reads da, gate and up again: a lean
(checkpointed) layer's backward read three [tokens, intermediate] bf16 tensors three
times and wrote three, 2.35 GB a layer for a Llama-3-8B shape at 4x2048. Here one kernel
reads each input once and writes every result: 1.41 GB. The inputs are narrowed to bf16
(a cast that fuses into their producers, or that the GEMM pass turns into the GEMMs'
bf16 outputs), the math runs in fp32 registers (sigmoid once per element), the results
are written in bf16 and widened per reader like any bf16 activation (the GEMMs after
them read the bf16 originals). Elementwise over any shape: one kernel per shape and dtype.
"""
from __future__ import annotations

from lorac.graphs.mlp import SWIGLU_GRAD, SWIGLU_GRAD_ACT

THREADS = 128


def compute(shape: tuple, dtype: str, with_act: bool):
    """The unscheduled PrimFunc (da, gate, up, dgate, dup[, act]), one loop nest writing
    every result (graphs/mlp.py has the derivation)."""
    import tvm
    from tvm import te

    da, gate, up = (te.placeholder(shape, dtype, name=n) for n in ("da", "gate", "up"))

    def body(*i):
        g, u, d = (x(*i).astype("float32") for x in (gate, up, da))
        sg = tvm.tirx.sigmoid(g)
        silu = g * sg
        outs = [d * u * (sg * (1.0 + g * (1.0 - sg))), d * silu] + ([silu * u] if with_act else [])
        return tuple(o.astype(dtype) for o in outs)

    outs = te.compute(shape, body, name="swiglu_grad")
    # no global symbol: the module it joins names it
    return te.create_prim_func([da, gate, up, *outs]).without_attr("global_symbol")


def kernel(shape: tuple, dtype: str, with_act: bool):
    """`compute` scheduled for CUDA: [blocks, 128 threads, a vector of 4 (2, 1) elements],
    every input element loaded once per thread."""
    from tvm import s_tir

    sch = s_tir.Schedule(compute(shape, dtype, with_act))
    loops = sch.get_loops(sch.get_sblock("swiglu_grad_v0"))
    fused = sch.fuse(*loops) if len(loops) > 1 else loops[0]
    total = 1
    for d in shape:
        total *= int(d)
    vec = next((v for v in (4, 2) if total % (v * THREADS) == 0), 1)
    bx, tx, vx = sch.split(fused, factors=[None, THREADS, vec])
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")
    if vec > 1:
        sch.vectorize(vx)
    # scheduled here: DLight leaves it alone
    return sch.mod["main"].with_attr({"tirx.noalias": True, "tirx.is_scheduled": True})


def converters(narrow: str = "bfloat16") -> dict:
    """Converter classes for the frontend (compiler.units.frontend_with)."""
    from tvm import relax

    kernels: dict = {}

    def convert(with_act: bool):
        def fn(bb, inputs, _attrs, _params):
            x = [i if i.ty.dtype == narrow else bb.emit(relax.op.astype(i, narrow)) for i in inputs]
            shape = tuple(int(d) for d in x[1].ty.shape.values)
            key = (shape, with_act)
            if key not in kernels:
                kernels[key] = bb.add_func(kernel(shape, narrow, with_act), "lorac_swiglu_grad")
            n = 3 if with_act else 2
            out = bb.emit(relax.call_tir(kernels[key], x, [relax.TensorType(list(shape), narrow)] * n))
            return relax.Tuple([bb.emit(relax.op.astype(bb.emit(relax.TupleGetItem(out, k)), "float32"))
                                for k in range(n)])
        return fn

    def converter(name, fn):
        """A converter class as the frontend's op table holds them (get_converter(opset))."""
        return type(name, (), {"get_converter": classmethod(lambda cls, _opset: fn)})

    return {SWIGLU_GRAD: converter(SWIGLU_GRAD, convert(False)),
            SWIGLU_GRAD_ACT: converter(SWIGLU_GRAD_ACT, convert(True))}
