"""Grouped-query causal attention, forward and backward.

Shapes: B batch, S seq, K kv heads, G = H/K query heads per kv head, Dh head dim.
q [B, H, S, Dh] is viewed as [B, K, G*S, Dh] (HF's repeat_kv gives query head k*G+g the kv
head k), so each kv head meets its G query heads in one batched matmul: no copies of k/v,
and dk, dv sum over the group inside the matmul.
"""
from __future__ import annotations

import numpy as np

MASKED = -1e30  # finite: exp underflows to exactly 0, and no inf-inf NaNs in any dtype


def causal_mask(g, seq: int, group: int):
    """bool [G*S, S]: row r (position r mod S) may attend to columns <= its position."""
    rows = g.const((np.arange(group * seq, dtype=np.int64) % seq)[:, None])
    cols = g.const(np.arange(seq, dtype=np.int64)[None, :])
    return g.op("LessOrEqual", cols, rows)


def attention_forward(g, q, k, v, mask, dims):
    B, K, G, S, Dh = dims
    qg = g.reshape(q, B, K, G * S, Dh)
    # scores = q k^T / sqrt(Dh), masked above the diagonal; p = softmax(scores)
    s = g.op("Mul", g.matmul(qg, g.transpose(k, 0, 1, 3, 2)), g.f(Dh ** -0.5))
    p = g.op("Softmax", g.op("Where", mask, s, g.f(MASKED)), axis=-1)
    ctx = g.reshape(g.matmul(p, v), B, K * G, S, Dh)
    return ctx, (qg, k, v, p)


def attention_backward(g, dctx, saved, dims):
    B, K, G, S, Dh = dims
    qg, k, v, p = saved
    dc = g.reshape(dctx, B, K, G * S, Dh)
    # ctx = p v: dp = dc v^T, dv = p^T dc (the matmul sums the G query heads of each kv head)
    dp = g.matmul(dc, g.transpose(v, 0, 1, 3, 2))
    dv = g.matmul(g.transpose(p, 0, 1, 3, 2), dc)
    # softmax: ds = p * (dp - sum(dp * p)); masked entries have p = 0 so ds = 0 there
    ds = g.op("Mul", p, g.op("Sub", dp, g.reduce_sum(g.op("Mul", dp, p), -1)))
    ds = g.op("Mul", ds, g.f(Dh ** -0.5))
    # s = q k^T * c: dq = ds k, dk = ds^T q
    dq = g.reshape(g.matmul(ds, k), B, K * G, S, Dh)
    dk = g.matmul(g.transpose(ds, 0, 1, 3, 2), qg)
    return dq, dk, dv
