"""Grouped-query causal attention as two units (lorac.CausalAttention, .CausalAttentionGrad),
and its packed variant (lorac.PackedCausalAttention, .PackedCausalAttentionGrad).

Shapes: B batch, S seq, H = K*G query heads, K kv heads, G query heads per kv head, Dh
head dim. Units take and return the token-major layout the projections produce,
q [B, S, H, Dh], k, v [B, S, K, Dh] (no transposes around them in the graph), and
lse [B, H, S, 1], the log-sum-exp of each softmax row (fp32), which is all the backward
needs besides q, k, v, o: it recomputes the probabilities instead of storing the
[B, H, S, S] matrix, as FlashAttention does and as cuDNN's SDPA expects.

The softmax scale (Dh^-1/2 by default) is the units' last input, a scalar constant.
Each unit is an ONNX local function (graphs/builder.GraphBuilder.call) whose body below
is plain ONNX: the checker, onnxruntime and TVM's CPU build inline it; the CUDA build
maps each unit whole to cuDNN's fused SDPA forward/backward (lorac.compiler.units).
Inside a body, q [B, H, S, Dh] is viewed as [B, K, G*S, Dh] (HF's repeat_kv gives query
head k*G+g the kv head k), so each kv head meets its G query heads in one batched
matmul: no copies of k/v, and dk, dv sum over the group inside the matmul.

Packed rows (`--packing isolated`, docs/DATA.md): the packed units take the rows'
position ids pos [B, S] (int64) before the scale, numbered 0, 1, ... from each document's
start as HF's padding-free collator does. A query at index i with position p = pos[b, i]
began its document at index i - p, so it sees exactly the keys j with i - p <= j <= i:
causal AND same document (a block-diagonal causal mask), with no document ids needed.
Only the mask differs from the plain units, so the forward and backward bodies are the
same (a masked score is -1e30 and its probability exactly 0 in both); every query sees
at least itself, so no softmax row is empty. The CUDA build inlines the packed units
(cuDNN's SDPA mapping covers only the plain causal mask: docs/COMPILER.md).
"""
from __future__ import annotations

import numpy as np

MASKED = -1e30  # finite: exp underflows to exactly 0, and no inf-inf NaNs in any dtype


def _variant(dims, np_float) -> str:
    B, K, G, S, Dh = dims
    return f"B={B} S={S} K={K} G={G} Dh={Dh} {np.dtype(np_float).name}"


def attention_forward(g, q, k, v, dims, scale: float | None = None, positions=None):
    """(o [B, S, H, Dh], saved for the backward). `positions` [B, S] int64: packed rows,
    each query attends only within its own document (the packed units)."""
    scale = dims[4] ** -0.5 if scale is None else scale
    c = g.f(scale)
    if positions is None:
        o, lse = g.call("CausalAttention", _variant(dims, g.np_float), [q, k, v, c], 2,
                        lambda fb, *x: _forward_body(fb, *x, dims))
        return o, (q, k, v, o, lse, c, None)
    o, lse = g.call("PackedCausalAttention", _variant(dims, g.np_float), [q, k, v, positions, c], 2,
                    lambda fb, q_, k_, v_, pos, c_: _forward_body(fb, q_, k_, v_, c_, dims, pos))
    return o, (q, k, v, o, lse, c, positions)


def attention_backward(g, do, saved, dims):
    """do = dLoss/do [B, S, H, Dh] -> (dq, dk, dv) in the layouts of q, k, v."""
    q, k, v, o, lse, c, positions = saved
    if positions is None:
        return g.call("CausalAttentionGrad", _variant(dims, g.np_float), [q, k, v, o, do, lse, c], 3,
                      lambda fb, *x: _backward_body(fb, *x, dims))
    return g.call("PackedCausalAttentionGrad", _variant(dims, g.np_float), [q, k, v, o, do, lse, positions, c], 3,
                  lambda fb, q_, k_, v_, o_, do_, lse_, pos, c_: _backward_body(fb, q_, k_, v_, o_, do_, lse_, c_,
                                                                               dims, pos))


# -- the unit bodies (default-domain ONNX) ------------------------------------------------
def _grouped(fb, x, dims):
    """[B, S, H, Dh] -> [B, K, G*S, Dh] (heads first, each kv head's G query heads stacked)."""
    B, K, G, S, Dh = dims
    return fb.reshape(fb.transpose(x, 0, 2, 1, 3), B, K, G * S, Dh)


def _ungrouped(fb, x, dims, heads):
    """[B, heads', rows, Dh] -> [B, S, heads, Dh] (the inverse of _grouped)."""
    B, K, G, S, Dh = dims
    return fb.transpose(fb.reshape(x, B, heads, S, Dh), 0, 2, 1, 3)


def _masked_scores(fb, q, k, scale, dims, positions=None):
    """scale * q k^T as [B, K, G, S, S], -1e30 above the diagonal (position j > i) and, with
    `positions` [B, S], before the query's document start (j < i - positions[i])."""
    B, K, G, S, Dh = dims
    s = fb.matmul(_grouped(fb, q, dims), fb.transpose(k, 0, 2, 3, 1))  # [B, K, G*S, S]
    s = fb.reshape(fb.op("Mul", s, scale), B, K, G, S, S)
    pos = fb.op("Range", fb.const(np.int64(0)), fb.const(np.int64(S)), fb.const(np.int64(1)))
    mask = fb.op("LessOrEqual", fb.op("Unsqueeze", pos, fb.ints(0)), fb.op("Unsqueeze", pos, fb.ints(1)))
    if positions is not None:
        # i - j <= positions[b, i]: the key lies in the query's document; [B, 1, 1, S, S]
        back = fb.op("Sub", fb.op("Unsqueeze", pos, fb.ints(1)), fb.op("Unsqueeze", pos, fb.ints(0)))
        mask = fb.op("And", mask, fb.op("LessOrEqual", back, fb.op("Unsqueeze", positions, fb.ints(1, 2, 4))))
    return fb.op("Where", mask, s, fb.f(MASKED))


def _forward_body(fb, q, k, v, scale, dims, positions=None):
    B, K, G, S, Dh = dims
    # p = softmax(s); lse = m + log(sum exp(s - m)) with m the row max, so p = exp(s - lse).
    # lse feeds only the backward unit: autodiff tools differentiating o see plain Softmax
    s = _masked_scores(fb, q, k, scale, dims, positions)
    p = fb.reshape(fb.op("Softmax", s, axis=-1), B, K, G * S, S)
    o = _ungrouped(fb, fb.matmul(p, fb.transpose(v, 0, 2, 1, 3)), dims, K * G)
    m = fb.op("ReduceMax", s, fb.ints(-1), keepdims=1)
    total = fb.reduce_sum(fb.op("Exp", fb.op("Sub", s, m)), -1)
    lse = fb.reshape(fb.op("Add", m, fb.op("Log", total)), B, K * G, S, 1)
    return o, lse


def _backward_body(fb, q, k, v, o, do, lse, scale, dims, positions=None):
    B, K, G, S, Dh = dims
    # p recomputed from lse; masked entries give exp(-1e30 - lse) = 0 exactly
    s = _masked_scores(fb, q, k, scale, dims, positions)
    p = fb.op("Exp", fb.op("Sub", s, fb.reshape(lse, B, K, G, S, 1)))
    p4 = fb.reshape(p, B, K, G * S, S)
    dog = _grouped(fb, do, dims)
    # o = p v: dv = p^T do (the matmul sums the G query heads of each kv head), dp = do v^T
    dv = fb.matmul(fb.transpose(p4, 0, 1, 3, 2), dog)
    dp = fb.reshape(fb.matmul(dog, fb.transpose(v, 0, 2, 3, 1)), B, K, G, S, S)
    # softmax: ds = p * (dp - sum_j p dp), and sum_j p_ij dp_ij = do_i . o_i (rowsum D)
    rowsum = fb.reshape(fb.transpose(fb.reduce_sum(fb.op("Mul", do, o), -1), 0, 2, 1, 3), B, K, G, S, 1)
    ds = fb.op("Mul", fb.op("Mul", p, fb.op("Sub", dp, rowsum)), scale)
    ds = fb.reshape(ds, B, K, G * S, S)
    # s = c q k^T: dq = ds k, dk = ds^T q
    dq = fb.matmul(ds, fb.transpose(k, 0, 2, 1, 3))
    dk = fb.matmul(fb.transpose(ds, 0, 1, 3, 2), _grouped(fb, q, dims))
    return _ungrouped(fb, dq, dims, K * G), _ungrouped(fb, dk, dims, K), _ungrouped(fb, dv, dims, K)
