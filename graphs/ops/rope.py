"""Rotary position embedding in HF's rotate-half convention, forward and backward.

Shapes: x [..., Dh] with the sequence axis where cos, sin broadcast to it: [S, Dh] for
[B, h, S, Dh], [S, 1, Dh] for token-major [B, S, h, Dh] (both halves repeat the same
frequencies).
rot(x) = concat(-x2, x1) for halves x1, x2 of the last axis.
Packed rows (docs/DATA.md) number each document's tokens from 0: rope_at gathers the
table rows at the rows' position ids, [B, S, 1, Dh], and the same forward and backward
apply (positions are integers, with no gradient).
"""
from __future__ import annotations

import numpy as np


def rope_tables(seq: int, head_dim: int, theta: float):
    """cos and sin [S, Dh] computed as transformers does (fp32 inv_freq, fp32 products)."""
    exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv_freq = (np.float32(1.0) / (np.float32(theta) ** exponent)).astype(np.float32)
    freqs = np.arange(seq, dtype=np.float32)[:, None] * inv_freq[None, :]
    emb = np.concatenate([freqs, freqs], axis=-1)
    return np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)


def rope_at(g, cos, sin, positions):
    """cos, sin [P, Dh] tables read at positions [B, S] (int64, each < P) -> [B, S, 1, Dh]
    each, broadcast over the heads of token-major [B, S, heads, Dh] activations."""
    at = lambda table: g.op("Unsqueeze", g.op("Gather", table, positions, axis=0), g.ints(2))
    return at(cos), at(sin)


def _halves(g, x, half: int):
    return g.slice(x, 0, half, -1), g.slice(x, half, 2 * half, -1)


def rope_forward(g, x, cos, sin, head_dim: int):
    # y = x*cos + rot(x)*sin
    x1, x2 = _halves(g, x, head_dim // 2)
    rot = g.op("Concat", g.op("Neg", x2), x1, axis=-1)
    return g.op("Add", g.op("Mul", x, cos), g.op("Mul", rot, sin))


def rope_backward(g, dy, cos, sin, head_dim: int):
    # rot is the linear map R = [[0, -I], [I, 0]], so dx = dy*cos + R^T (dy*sin), R^T t = concat(t2, -t1)
    t1, t2 = _halves(g, g.op("Mul", dy, sin), head_dim // 2)
    return g.op("Add", g.op("Mul", dy, cos), g.op("Concat", t2, g.op("Neg", t1), axis=-1))
