"""RMSNorm over the last axis, forward and backward.

Shapes: x [..., D], w [D]. The weight is frozen (no dw): LoRA never adapts norms.
"""
from __future__ import annotations


def rmsnorm_forward(g, x, w, eps: float):
    # y = xhat * w, xhat = x * rstd, rstd = (mean(x^2) + eps)^(-1/2); keep xhat and rstd for backward
    ms = g.reduce_mean(g.op("Mul", x, x), -1)
    rstd = g.op("Reciprocal", g.op("Sqrt", g.op("Add", ms, g.f(eps))))
    xhat = g.op("Mul", x, rstd)
    return g.op("Mul", xhat, w), (xhat, rstd)


def rmsnorm_backward(g, dy, w, saved):
    # with gw = dy*w: dxhat = gw and d rstd/dx = -rstd^3 x / D, so
    # dx = rstd * (gw - xhat * mean(gw * xhat))
    xhat, rstd = saved
    gw = g.op("Mul", dy, w)
    dot = g.reduce_mean(g.op("Mul", gw, xhat), -1)
    return g.op("Mul", g.op("Sub", gw, g.op("Mul", xhat, dot)), rstd)
