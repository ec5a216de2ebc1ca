"""SwiGLU's backward units on CUDA bf16, mapped whole to one kernel each (graphs/ops/mlp.py).

    SwiGLUGrad(da, gate, up)     -> dgate, dup
    SwiGLUGradAct(da, gate, up)  -> dgate, dup, act = silu(gate) * up

Inlined, each result is a TVM kernel of its own that reads da, gate and up again: a lean
(checkpointed) layer's backward read three [tokens, intermediate] bf16 tensors three
times and wrote three, 2.35 GB a layer for a Llama-3-8B shape at 4x2048. Here one kernel
reads each input once and writes every result over its inputs: 1.41 GB, and no memory
beyond the inputs (written to new tensors, the three results raised the 8B step's peak,
in the top layer's backward, by 0.47 GB). The inputs are narrowed to bf16
(a cast that fuses into their producers, or that the GEMM pass turns into the GEMMs'
bf16 outputs), the math runs in fp32 registers (sigmoid once per element), the results
are written in bf16 and widened per reader like any bf16 activation (the GEMMs after
them read the bf16 originals). Elementwise over any shape: one kernel per element count.
"""
from __future__ import annotations

import math

from lorac.graphs.ops.mlp import SWIGLU_GRAD, SWIGLU_GRAD_ACT

THREADS = 128


def kernel(n: int, dtype: str, with_act: bool, gpu: bool = True):
    """The PrimFunc over n elements, in place: (da, gate, up) become (dgate, gate, dup) or,
    with `with_act`, (dgate, act, dup). Each thread loads its elements of the three inputs,
    computes in fp32 registers (sigmoid once) and stores over them, so the unit needs no
    memory beyond its inputs: their last reader is the unit (a layer's gate and up are read
    by nothing after its SwiGLU backward, da is made for it). On CUDA [blocks, 128 threads,
    a vector of 4 (2, 1) elements]; `gpu=False` is one serial loop, for tests on the CPU."""
    from tvm import tirx
    from tvm.script.ir_builder import IRBuilder
    from tvm.script.ir_builder import tirx as T

    vec = next((v for v in (4, 2) if n % (v * THREADS) == 0), 1)

    def element(da, gate, up, i):
        d, g, u = (T.bind(tirx.Cast("float32", b[i])) for b in (da, gate, up))
        sg = T.bind(tirx.sigmoid(g))
        silu = g * sg
        T.buffer_store(da, tirx.Cast(dtype, d * u * (sg * (1.0 + g * (1.0 - sg)))), [i])
        T.buffer_store(up, tirx.Cast(dtype, d * silu), [i])
        if with_act:
            T.buffer_store(gate, tirx.Cast(dtype, silu * u), [i])

    with IRBuilder() as ib:
        with T.prim_func():
            # scheduled here (DLight leaves it alone); opaque to FuseOps (a producer fused into
            # an in-place kernel would leave FuseTIR two buffers for one argument); no global
            # symbol: the module it joins names it
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, "op_pattern": 8})
            da, gate, up = (T.arg(name, T.buffer((n,), dtype)) for name in ("da", "gate", "up"))
            if not gpu:
                with T.serial(0, n) as i:
                    element(da, gate, up, i)
            else:
                blocks = -(-n // (THREADS * vec))
                with T.launch_thread("blockIdx.x", blocks) as bx, T.launch_thread("threadIdx.x", THREADS) as tx:
                    with T.vectorized(0, vec) as v:
                        i = (bx * THREADS + tx) * vec + v
                        if vec > 1:  # n is a multiple of the block's elements
                            element(da, gate, up, i)
                        else:
                            with T.If(i < n):
                                with T.Then():
                                    element(da, gate, up, i)
    return ib.get()


def converters(narrow: str = "bfloat16") -> dict:
    """Converter classes for the frontend (compiler.units.frontend_with)."""
    from tvm import relax

    from ..passes.gemm import _static_shape
    from . import unit_converter

    kernels: dict = {}

    def convert(with_act: bool):
        def fn(bb, inputs, _attrs, _params):
            shape = _static_shape(inputs[1].ty)
            n = math.prod(shape)
            # flat bf16 views (reshapes are free); the kernel writes over them
            x = [bb.emit(relax.op.reshape(i if i.ty.dtype == narrow else bb.emit(relax.op.astype(i, narrow)), [n]))
                 for i in inputs]
            key = (n, with_act)
            if key not in kernels:
                kernels[key] = bb.add_func(kernel(n, narrow, with_act), "lorac_swiglu_grad")
            order = [0, 2, 1] if with_act else [0, 2]  # dgate in da, dup in up, act in gate
            out = bb.emit(relax.call_tir_inplace(kernels[key], x, [0, 1, 2],
                                                 [relax.TensorType([n], narrow)] * 3))
            return relax.Tuple([bb.emit(relax.op.astype(bb.emit(relax.op.reshape(
                bb.emit(relax.TupleGetItem(out, k)), shape)), "float32")) for k in order])
        return fn

    return {SWIGLU_GRAD: unit_converter(SWIGLU_GRAD, convert(False)),
            SWIGLU_GRAD_ACT: unit_converter(SWIGLU_GRAD_ACT, convert(True))}
