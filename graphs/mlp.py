"""SwiGLU activation a = silu(gate) * up, forward and backward. Shapes: gate, up [N, I]."""
from __future__ import annotations


def swiglu_forward(g, gate, up):
    # silu(x) = x sigmoid(x); keep sigmoid(gate) for backward
    sg = g.op("Sigmoid", gate)
    return g.op("Mul", g.op("Mul", gate, sg), up), sg


def swiglu_backward(g, da, gate, up, sg):
    # d silu/dx = sg (1 + x (1 - sg)); dgate = da up silu'(gate), dup = da silu(gate)
    one = g.f(1.0)
    dsilu = g.op("Mul", sg, g.op("Add", one, g.op("Mul", gate, g.op("Sub", one, sg))))
    dgate = g.op("Mul", g.op("Mul", da, up), dsilu)
    dup = g.op("Mul", da, g.op("Mul", gate, sg))
    return dgate, dup
