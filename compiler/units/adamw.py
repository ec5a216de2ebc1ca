"""The optimizer's AdamWStep units on CUDA: one kernel per bucket that updates p, m and v in place.

    AdamWStep(p, m, v, grad, c, ok, lr, bc1, bc2, b1, 1-b1, b2, 1-b2, eps, wd) -> p', m', v'

(graphs/optimizer.py has the math; c is the clip factor, ok whether the gradient norm is
finite, bc1/bc2 the bias corrections.) Inlined, the update is three kernels per bucket that
each read the gradient and the moments again, and its results are new buffers: between
steps the device held two generations of the LoRA state, and the step's plan kept the
temporaries (for a Llama-3-8B adapter, 42M parameters: 0.5 GB and 0.26 GB). Here each
thread reads its element of p, m, v and grad once and, when `ok`, writes p', m', v' over
them (a skipped step writes nothing: the state stays bit for bit); the constants b1 .. wd
are compile-time values of the graph, baked into the kernel.
"""
from __future__ import annotations

from lorac.graphs.optimizer import ADAMW_STEP

THREADS = 256


def kernel(n: int, scalar_shapes: list, consts: tuple, gpu: bool = True):
    """PrimFunc (p, m, v, grad [n], c, ok, lr, bc1, bc2 of `scalar_shapes`); `consts` =
    (b1, 1-b1, b2, 1-b2, eps, wd) as float32 values. `gpu=False`: a serial loop (tests)."""
    from tvm import tirx
    from tvm.script.ir_builder import IRBuilder
    from tvm.script.ir_builder import tirx as T

    b1, one_b1, b2, one_b2, eps, wd = (tirx.const(x, "float32") for x in consts)
    dtypes = ("float32", "bool", "float32", "float32", "float32")

    def element(p, m, v, grad, c, ok, lr, bc1, bc2, i):
        scalar = lambda buf: buf[tuple(0 for _ in buf.shape)] if buf.shape else tirx.BufferLoad(buf, [])
        with T.If(scalar(ok)):
            with T.Then():
                g = T.bind(grad[i] * scalar(c))
                m1 = T.bind(b1 * m[i] + one_b1 * g)
                v1 = T.bind(b2 * v[i] + one_b2 * (g * g))
                upd = m1 / scalar(bc1) / (tirx.sqrt(v1 / scalar(bc2)) + eps) + wd * p[i]
                T.buffer_store(p, p[i] - scalar(lr) * upd, [i])
                T.buffer_store(m, m1, [i])
                T.buffer_store(v, v1, [i])

    with IRBuilder() as ib:
        with T.prim_func():
            # scheduled here; opaque to FuseOps (in place); no global symbol: the module names it
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, "op_pattern": 8})
            vecs = [T.arg(name, T.buffer((n,), "float32")) for name in ("p", "m", "v", "grad")]
            scalars = [T.arg(name, T.buffer(shape, dt)) for name, shape, dt in
                       zip(("c", "ok", "lr", "bc1", "bc2"), scalar_shapes, dtypes)]
            if not gpu:
                with T.serial(0, n) as i:
                    element(*vecs, *scalars, i)
            else:
                with T.launch_thread("blockIdx.x", -(-n // THREADS)) as bx, T.launch_thread("threadIdx.x", THREADS) as tx:
                    i = bx * THREADS + tx
                    with T.If(i < n):
                        with T.Then():
                            element(*vecs, *scalars, i)
    return ib.get()


def _const(x) -> float:
    import numpy as np
    import tvm
    if not isinstance(x, tvm.ir.expr.Constant):
        raise ValueError("AdamWStep unit: betas, eps and weight decay must be constants")
    return float(np.float32(x.value.numpy()))


def converters(gpu: bool = True) -> dict:
    """Converter classes for the frontend (compiler.units.frontend_with); `gpu=False` maps
    the unit to the serial kernel (tests on the CPU)."""
    from tvm import relax

    from ..passes.gemm import _static_shape
    from . import unit_converter

    kernels: dict = {}

    def convert(bb, inputs, _attrs, _params):
        p, m, v, grad, c, ok, lr, bc1, bc2 = inputs[:9]
        consts = tuple(_const(x) for x in inputs[9:])
        n = _static_shape(p.ty)[0]
        scalars = [c, ok, lr, bc1, bc2]
        key = (n, tuple(tuple(_static_shape(x.ty)) for x in scalars), consts)
        if key not in kernels:
            kernels[key] = bb.add_func(kernel(n, list(key[1]), consts, gpu), "lorac_adamw_step")
        out = bb.emit(relax.call_tir_inplace(kernels[key], [p, m, v, grad, *scalars], [0, 1, 2],
                                             [p.ty, m.ty, v.ty]))
        return relax.Tuple([bb.emit(relax.TupleGetItem(out, k)) for k in range(3)])

    return {ADAMW_STEP: unit_converter(ADAMW_STEP, convert)}
