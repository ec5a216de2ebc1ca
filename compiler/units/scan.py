"""The Mamba scan units, mapped whole to lorac's own TIR kernels (compiler/units/scan_kernels.py:
scan_cpu.py on the CPU, scan_gpu.py on CUDA); the other targets inline the units' bodies
(compiler/units/__init__.py).

    SelectiveScan(u, dt, A, Bm, Cm, D; chunk)              -> y, hs
        call_tir(lorac_scan_fwd_<cpu|cuda>)
    SelectiveScanGrad(dy, u, dt, A, Bm, Cm, D, hs; chunk)  -> du, ddt, dBm, dCm
        call_tir(lorac_scan_bwd_<cpu|cuda>) -> du, ddt, dBm and dCm partials [B, P, S, M],
        each partial summed over P (a plain reduction)

Shapes as in graphs/ops/scan.py; `chunk` (L) is the call node's attribute. hs [B, C, I, M] is the
state entering each chunk, the same tensor the body computes, so the backward kernel
recomputes each chunk's states from it instead of reading B x S x I x M saved states. The
kernels are added to the module once per shape (every layer calls the same two).
`narrow`: a dtype (bfloat16) the activations u, dt, Bm, Cm and dy are cast to before the
kernels read them (the cast fuses into their producers; each value is narrowed once, so the
forward and its backward share the copy); states and sums stay fp32.
"""
from __future__ import annotations

FORWARD, BACKWARD = "SelectiveScan", "SelectiveScanGrad"


def _shape(x) -> list[int]:
    return [int(v) for v in x.ty.shape.values]


def converters(gpu: bool, narrow: str | None = None) -> dict:
    """Converter classes for the frontend (compiler.units.frontend_with), sharing one table
    of added kernels and one of narrowed values for the whole graph."""
    from tvm import relax

    from lorac.graphs.ops.scan import ScanDims

    from . import scan_kernels as sk
    from .scan_cpu import backward_cpu, forward_cpu
    from .scan_gpu import backward_gpu, forward_gpu
    from . import unit_converter

    kernels: dict = {}
    narrowed: dict = {}
    fwd_make, bwd_make = (forward_gpu, backward_gpu) if gpu else (forward_cpu, backward_cpu)

    def kernel(bb, make, d: ScanDims, dtype: str):
        key = (make.__name__, d, dtype)
        if key not in kernels:
            kernels[key] = bb.add_func(make(d, dtype), f"lorac_{make.__name__}")
        return kernels[key]

    def activation(bb, x):
        if narrow is None or x.ty.dtype != "float32":
            return x
        if x not in narrowed:
            narrowed[x] = bb.emit(relax.op.astype(x, narrow))
        return narrowed[x]

    def dims(u, A, attrs) -> ScanDims:
        B, S, I = _shape(u)
        return ScanDims(B, S, I, _shape(A)[1], int(attrs["chunk"]))

    def forward(bb, inputs, attrs, _params):
        u, dt, A, Bm, Cm, D = inputs
        d = dims(u, A, attrs)
        u, dt, Bm, Cm = (activation(bb, x) for x in (u, dt, Bm, Cm))
        acc = sk.accumulator(u.ty.dtype)
        out = bb.emit(relax.call_tir(kernel(bb, fwd_make, d, u.ty.dtype), [u, dt, A, Bm, Cm, D], [
            relax.TensorType([d.batch, d.seq, d.channels], acc),
            relax.TensorType([d.batch, d.n_chunks, d.channels, d.state], acc)]))
        return relax.Tuple([bb.emit(relax.TupleGetItem(out, k)) for k in range(2)])

    def backward(bb, inputs, attrs, _params):
        dy, u, dt, A, Bm, Cm, D, hs = inputs
        d = dims(u, A, attrs)
        dy, u, dt, Bm, Cm = (activation(bb, x) for x in (dy, u, dt, Bm, Cm))
        acc = sk.accumulator(u.ty.dtype)
        B, S, I, M, P = d.batch, d.seq, d.channels, d.state, sk.partials(d, gpu)
        out = bb.emit(relax.call_tir(kernel(bb, bwd_make, d, u.ty.dtype), [dy, u, dt, A, Bm, Cm, D, hs], [
            relax.TensorType([B, S, I], acc), relax.TensorType([B, S, I], acc),
            relax.TensorType([B, P, S, M], acc), relax.TensorType([B, P, S, M], acc)]))
        du, ddt, dBp, dCp = (bb.emit(relax.TupleGetItem(out, k)) for k in range(4))
        return relax.Tuple([du, ddt, bb.emit(relax.op.sum(dBp, axis=[1])), bb.emit(relax.op.sum(dCp, axis=[1]))])

    return {FORWARD: unit_converter(FORWARD, forward), BACKWARD: unit_converter(BACKWARD, backward)}
