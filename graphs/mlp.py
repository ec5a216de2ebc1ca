"""SwiGLU activation a = silu(gate) * up, forward and backward. Shapes: gate, up [N, I]."""
from __future__ import annotations


def swiglu_forward(g, gate, up):
    # silu(x) = x sigmoid(x). Nothing beyond gate and up is kept: the backward recomputes
    # sigmoid(gate) inside its own kernel, cheaper than storing an [N, I] fp32 tensor and
    # reading it back (a separate sigmoid kernel and 96 MB a layer for Qwen3-0.6B at 8x1024)
    return g.op("Mul", g.op("Mul", gate, g.op("Sigmoid", gate)), up)


def swiglu_backward(g, da, gate, up):
    # d silu/dx = sg (1 + x (1 - sg)); dgate = da up silu'(gate), dup = da silu(gate).
    # Each result computes sigmoid(gate) itself: one shared sigmoid would be a kernel of its
    # own, writing [N, I] fp32 that both results' kernels then read
    one = g.f(1.0)
    sg = g.op("Sigmoid", gate)
    dsilu = g.op("Mul", sg, g.op("Add", one, g.op("Mul", gate, g.op("Sub", one, sg))))
    dgate = g.op("Mul", g.op("Mul", da, up), dsilu)
    dup = g.op("Mul", da, g.op("Mul", gate, g.op("Sigmoid", gate)))
    return dgate, dup
