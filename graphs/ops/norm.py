"""RMSNorm over the last axis, forward and backward.

Shapes: x [..., D], w [D]. The weight is frozen (no dw): LoRA never adapts norms.
"""
from __future__ import annotations


def rmsnorm_forward(g, x, w, eps: float):
    # y = xhat * w, xhat = x * rstd, rstd = (mean(x^2) + eps)^(-1/2). Kept for the backward:
    # x and rstd, not xhat. xhat would be a tensor of its own (a kernel writing it, as y has
    # other readers), while x is already stored (a residual sum or a GEMM's bf16 result) and
    # the backward's kernels recompute xhat as they read it
    # means as sums times 1/D: TVM 0.27 fuses a product into a sum's kernel but not into a
    # mean's, where it became a kernel of its own writing x^2 (on the H200, 5 % of a
    # Qwen3-0.6B step)
    saved = rmsnorm_stats(g, x, int(w.shape[0]), eps)
    return rmsnorm_apply(g, w, saved), saved


def rmsnorm_stats(g, x, width: int, eps: float):
    """What the backward keeps of a norm over the last axis (`width` values): (x, rstd)."""
    ms = g.op("Mul", g.reduce_sum(g.op("Mul", x, x), -1), g.f(1.0 / width))
    return x, g.op("Reciprocal", g.op("Sqrt", g.op("Add", ms, g.f(eps))))


def rmsnorm_apply(g, w, saved):
    """The forward's y again, from what it kept: a backward recomputes y instead of keeping it."""
    x, rstd = saved
    return g.op("Mul", g.op("Mul", x, rstd), w)


def rmsnorm_backward(g, dy, w, saved):
    # with gw = dy*w: dxhat = gw and d rstd/dx = -rstd^3 x / D, so
    # dx = rstd * (gw - xhat * mean(gw * xhat))
    # gw is emitted twice, once for the row sum and once for dx: one shared product has two
    # readers of different kinds (a reduction, an elementwise kernel), so FuseOps made it a
    # kernel of its own writing an fp32 [tokens, D] copy read back twice (bf16 dy read once
    # per reader instead: 64 such kernels and ~6 ms of a Llama-3-8B 4x2048 step on the H100)
    x, rstd = saved
    dot = g.op("Mul", g.reduce_sum(g.op("Mul", g.op("Mul", dy, w), g.op("Mul", x, rstd)), -1),
               g.f(1.0 / int(w.shape[0])))
    return g.op("Mul", g.op("Sub", g.op("Mul", dy, w), g.op("Mul", g.op("Mul", x, rstd), dot)), rstd)
