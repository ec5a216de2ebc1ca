"""LM head + masked next-token cross-entropy, forward and backward in one pass.

Shapes: N = B*S tokens, D hidden, V vocab; h [N, D], E [V, D] (tied embedding or lm_head).
labels follow HF: the graph shifts them (position t predicts labels[t+1]); -100 is ignored;
the loss is the mean over counted tokens. Nothing upstream of the logits needs the loss
value, so the gradient is formed right here and the [N, V] logits die chunk by chunk.
"""
from __future__ import annotations

import numpy as np

from .builder import FLOAT

IGNORE = -100


def shifted_targets(g, labels, batch: int, seq: int):
    """-> (targets [N, 1] with ignored ones replaced by 0, weight [N, 1] = counted / n_counted)."""
    n = batch * seq
    nxt = g.slice(labels, 1, seq, 1)
    t = g.reshape(g.op("Concat", nxt, g.const(np.full((batch, 1), IGNORE, np.int64)), axis=1), n, 1)
    valid = g.op("Not", g.op("Equal", t, g.const(np.int64(IGNORE))))
    safe = g.op("Where", valid, t, g.const(np.int64(0)))
    validf = g.op("Cast", valid, to=FLOAT)
    # count >= 1 so an all-ignored batch gives loss 0 and zero gradients, not NaN
    count = g.op("Max", g.reduce_sum(validf, 0, 1), g.f(1.0))
    return safe, g.op("Div", validf, count)


def logits_forward(g, h, head):
    return g.mm_t(h, head)


def ce_forward_backward(g, h, head, safe, weight, vocab: int):
    """One chunk: -> (sum of weighted nll [1, 1], dh [n, D])."""
    logits = g.mm_t(h, head)
    # log-softmax with the max subtracted: lse = log sum exp(z), z = logits - max
    z = g.op("Sub", logits, g.op("ReduceMax", logits, g.ints(-1), keepdims=1))
    ez = g.op("Exp", z)
    se = g.reduce_sum(ez, -1)
    nll = g.op("Sub", g.op("Log", se), g.op("GatherElements", z, safe, axis=1))
    loss = g.reduce_sum(g.op("Mul", nll, weight), 0, 1)
    # d loss / d logits = (softmax - onehot(target)) * weight; then dh = dlogits E
    vocab_ids = g.op("Range", g.const(np.int64(0)), g.const(np.int64(vocab)), g.const(np.int64(1)))
    onehot = g.op("Cast", g.op("Equal", safe, vocab_ids), to=FLOAT)
    dlogits = g.op("Mul", g.op("Sub", g.op("Div", ez, se), onehot), weight)
    return loss, g.matmul(dlogits, head)


def loss_and_grad(g, h, head, labels, batch: int, seq: int, vocab: int, chunk: int):
    """Mean masked CE over all tokens -> (loss [1, 1], dh [N, D]); `chunk` tokens per piece (0: all)."""
    n = batch * seq
    safe, weight = shifted_targets(g, labels, batch, seq)
    chunk = n if chunk <= 0 or chunk >= n else chunk
    losses, grads = [], []
    for lo in range(0, n, chunk):
        hi = min(lo + chunk, n)
        pick = (lambda v: v) if chunk == n else (lambda v: g.slice(v, lo, hi, 0))
        part, dh = ce_forward_backward(g, pick(h), head, pick(safe), pick(weight), vocab)
        losses.append(part)
        grads.append(dh)
    loss = losses[0] if len(losses) == 1 else g.op("Sum", *losses)
    dh = grads[0] if len(grads) == 1 else g.op("Concat", *grads, axis=0)
    return loss, dh
