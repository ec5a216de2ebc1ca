"""LM head + masked next-token cross-entropy, forward and backward in one pass.

Shapes: N = B*S tokens, D hidden, V vocab; h [N, D], E [V, D] (tied embedding or lm_head).
A quantized E (QLoRA's embeddings: graphs/ops/quant.py) is read in vocabulary slices, each
dequantized right before the GEMM that reads it, so no dense head outlives a GEMM.
labels follow HF: the graph shifts them (position t predicts labels[t+1]); -100 is ignored;
the loss is the mean over counted tokens. Nothing upstream of the logits needs the loss
value, so the gradient is formed right here and the [N, V] logits die chunk by chunk.
"""
from __future__ import annotations

import numpy as np

from ..builder import INT32

IGNORE = -100


def shifted_targets(g, labels, batch: int, seq: int):
    """-> (targets [N, 1] int32 with ignored ones replaced by 0, weight [N, 1] = counted / n_counted).
    The shift runs in int32 (token ids < 2^31): WebGPU has no 64-bit integers, and
    onnxruntime's WebGPU EP ran these nodes on the CPU in int64."""
    n = batch * seq
    nxt = g.slice(g.op("Cast", labels, to=INT32), 1, seq, 1)
    t = g.reshape(g.op("Concat", nxt, g.const(np.full((batch, 1), IGNORE, np.int32)), axis=1), n, 1)
    valid = g.op("Not", g.op("Equal", t, g.const(np.int32(IGNORE))))
    safe = g.op("Where", valid, t, g.const(np.int32(0)))
    validf = g.op("Cast", valid, to=g.float)
    # count >= 1 so an all-ignored batch gives loss 0 and zero gradients, not NaN
    count = g.op("Max", g.reduce_sum(validf, 0, 1), g.f(1.0))
    return safe, g.op("Div", validf, count)


HEAD_SLICE_BYTES = 96 << 20  # a quantized head's vocabulary slice, dense in bf16 (1/11 of Llama-3-8B's head)


def head_slices(vocab: int, hidden: int, count: int = 0) -> list[tuple[int, int]]:
    """The vocabulary slices [lo, hi) a quantized LM head is read in: `count` of them (0: as many as
    keep each one's dense bf16 copy within HEAD_SLICE_BYTES), equal but for the last, their rows
    a multiple of 64 where there are that many. Llama-3-8B's head (128256 x 4096): 11 slices of
    11712 rows (96 MB in bf16); Llama-3-70B's (x 8192): 21 of 6144 rows."""
    count = count or -(-vocab * hidden * 2 // HEAD_SLICE_BYTES)
    rows = -(-vocab // max(1, min(count, vocab)))
    if rows > 64:
        rows = -(-rows // 64) * 64
    return [(lo, min(lo + rows, vocab)) for lo in range(0, vocab, rows)]


def _softcap(g, z, softcap: float | None):
    return z if not softcap else g.op("Mul", g.op("Tanh", g.op("Mul", z, g.f(1.0 / softcap))), g.f(softcap))


def logits_forward(g, h, head, softcap: float | None = None, slices: int = 0):
    """h E^T, soft-capped to c tanh(z / c) when the model says so (Gemma 2's final logits). A
    quantized head (graphs/ops/quant.py QuantWeight) is read in vocabulary slices, each
    dequantized just before its GEMM (`slices`: head_slices' count), the logits their Concat."""
    if not hasattr(head, "row_slice"):
        return _softcap(g, g.mm_t(h, head), softcap)
    parts = [_softcap(g, g.mm_t(h, head.row_slice(g, lo, hi)), softcap)
             for lo, hi in head_slices(head.out, head.inp, slices)]
    return parts[0] if len(parts) == 1 else g.op("Concat", *parts, axis=1)


def softcap_backward(g, dlogits, logits, softcap: float | None):
    # logits = c tanh(z / c): dz = dlogits (1 - (logits / c)^2)
    if not softcap:
        return dlogits
    t = g.op("Mul", logits, g.f(1.0 / softcap))
    return g.op("Mul", dlogits, g.op("Sub", g.f(1.0), g.op("Mul", t, t)))


def ce_forward(g, h, head, safe, weight, softcap: float | None = None):
    """One chunk: -> (sum of weighted nll [1, 1], (logits, lse) for the backward)."""
    logits = logits_forward(g, h, head, softcap)
    # nll = lse - logit[target] with lse = max + log sum exp(logits - max). exp(logits - max)
    # has the sum as its only reader, so it fuses into that reduction and is never stored
    top = g.op("ReduceMax", logits, g.ints(-1), keepdims=1)
    se = g.reduce_sum(g.op("Exp", g.op("Sub", logits, top)), -1)
    lse = g.op("Add", g.op("Log", se), top)
    nll = g.op("Sub", lse, g.op("GatherElements", logits, safe, axis=1))
    return g.reduce_sum(g.op("Mul", nll, weight), 0, 1), (logits, lse)


def ce_forward_backward(g, h, head, safe, weight, vocab: int, softcap: float | None = None):
    """One chunk: -> (sum of weighted nll [1, 1], dh [n, D])."""
    loss, (logits, lse) = ce_forward(g, h, head, safe, weight, softcap)
    # d loss / d logits = (softmax - onehot(target)) * weight, softmax = exp(logits - lse)
    # recomputed from the logits in the one kernel that writes dlogits (on the H200 keeping
    # exp(logits - max) for this cost a write and a read of a [2048, 151936] fp32 block per
    # chunk: 11 ms of a Qwen3-0.6B step); then dh = dlogits E
    # onehot(target) in float arithmetic, 1 - |target - id| clipped at 0 (ids are exact in
    # fp32 up to 2^24): no boolean in the kernel, which a GPU build can then vectorize
    ids = g.op("Range", g.f(0.0), g.f(float(vocab)), g.f(1.0))
    onehot = g.op("Relu", g.op("Sub", g.f(1.0), g.op("Abs", g.op("Sub", g.op("Cast", safe, to=g.float), ids))))
    dlogits = g.op("Mul", g.op("Sub", g.op("Exp", g.op("Sub", logits, lse)), onehot), weight)
    return loss, g.matmul(softcap_backward(g, dlogits, logits, softcap), head)


def sliced_ce_forward(g, h, head, safe, weight, softcap: float | None = None, slices: int = 0):
    """One chunk over a quantized head E (QuantWeight) read in vocabulary slices E_s (rows lo..hi),
    none of it dense beyond the GEMM that reads it: -> (sum of weighted nll [1, 1], (parts, z_s, lse)).
    z_s = h E_s^T (capped), kept for a backward as the dense logits are (no Concat: a copy of every
    chunk's logits); lse = M + log sum_s sum exp(z_s - M), M = max_s max z_s; the target's logit
    from the slice that holds it (its index clamped into every slice, counted in the holding one)."""
    parts = head_slices(head.out, head.inp, slices)
    zs = [_softcap(g, g.mm_t(h, head.row_slice(g, lo, hi)), softcap) for lo, hi in parts]
    tops = [g.op("ReduceMax", z, g.ints(-1), keepdims=1) for z in zs]
    top = tops[0] if len(tops) == 1 else g.op("Max", *tops)
    lse = g.op("Add", g.op("Log", g.add_all(*[g.reduce_sum(g.op("Exp", g.op("Sub", z, top)), -1) for z in zs])), top)
    picked = []
    for (lo, hi), z in zip(parts, zs):
        at = g.op("Min", g.op("Max", g.op("Sub", safe, g.const(np.int32(lo))), g.const(np.int32(0))),
                  g.const(np.int32(hi - lo - 1)))
        inside = g.op("And", g.op("GreaterOrEqual", safe, g.const(np.int32(lo))), g.op("Less", safe, g.const(np.int32(hi))))
        picked.append(g.op("Where", inside, g.op("GatherElements", z, at, axis=1), g.f(0.0)))
    nll = g.op("Sub", lse, g.add_all(*picked))
    return g.reduce_sum(g.op("Mul", nll, weight), 0, 1), (parts, zs, lse)


def sliced_ce_forward_backward(g, h, head, safe, weight, softcap: float | None = None, slices: int = 0):
    """sliced_ce_forward, then per slice, E_s dequantized again: dz_s = (exp(z_s - lse) - onehot_s)
    weight (dlogits, one slice wide), dh = sum_s dz_s E_s -> (sum of weighted nll [1, 1], dh)."""
    loss, (parts, zs, lse) = sliced_ce_forward(g, h, head, safe, weight, softcap, slices)
    target = g.op("Cast", safe, to=g.float)
    dh = None
    for (lo, hi), z in zip(parts, zs):
        ids = g.op("Range", g.f(float(lo)), g.f(float(hi)), g.f(1.0))
        onehot = g.op("Relu", g.op("Sub", g.f(1.0), g.op("Abs", g.op("Sub", target, ids))))
        dz = g.op("Mul", g.op("Sub", g.op("Exp", g.op("Sub", z, lse)), onehot), weight)
        part = g.matmul(softcap_backward(g, dz, z, softcap), head.row_slice(g, lo, hi))
        # the running sum kept (a kernel boundary): a chain of Adds over GEMM results would become
        # one accumulating GEMM call reading every slice's dz and E_s at once (compiler/passes/
        # gemm_sum.py), the whole head dense again; kept, each slice's pair dies at its own GEMM
        dh = part if dh is None else g.op("Add", g.kept(dh), part)
    return loss, dh


def auto_chunk(vocab: int, tokens: int, budget: int = 3 << 29) -> int:
    """Tokens per loss chunk so that one chunk's fp32 logits [chunk, V] take at most `budget` (1.5 GiB)
    bytes: a power of two >= 256, or 0 (one chunk) when all tokens fit. On the H200 the
    Qwen3-0.6B step at 8x1024 (V = 151936) plans 36.6 GB with one chunk and 28.8 GB with
    2048-token chunks (docs/BENCHMARKS.md)."""
    chunk = 256
    while chunk * 2 * vocab * 4 <= budget:
        chunk *= 2
    return 0 if chunk >= tokens else chunk


def _chunks(g, n: int, chunk: int):
    """Row selectors for `chunk`-token pieces of [N, ...] values (one piece when chunk is 0)."""
    if chunk <= 0 or chunk >= n:
        return [lambda v: v]
    return [lambda v, lo=lo: g.slice(v, lo, min(lo + chunk, n), 0) for lo in range(0, n, chunk)]


def _sum(g, parts):
    return parts[0] if len(parts) == 1 else g.op("Sum", *parts)


def loss_and_grad(g, h, head, labels, batch: int, seq: int, vocab: int, chunk: int, softcap: float | None = None,
                  slices: int = 0):
    """Mean masked CE over all tokens -> (loss [1, 1], dh [N, D]); `chunk` tokens per piece (0: all);
    a quantized head read in vocabulary slices (`slices`: head_slices' count)."""
    safe, weight = shifted_targets(g, labels, batch, seq)
    losses, grads = [], []
    for pick in _chunks(g, batch * seq, chunk):
        if hasattr(head, "row_slice"):
            part, dh = sliced_ce_forward_backward(g, pick(h), head, pick(safe), pick(weight), softcap, slices)
        else:
            part, dh = ce_forward_backward(g, pick(h), head, pick(safe), pick(weight), vocab, softcap)
        losses.append(part)
        grads.append(dh)
    return _sum(g, losses), grads[0] if len(grads) == 1 else g.op("Concat", *grads, axis=0)


def ce_loss(g, h, head, safe, weight, softcap: float | None = None, slices: int = 0):
    """One chunk of the eval loss through ONNX LogSoftmax (nothing kept for a backward);
    an independent formulation, so autodiff oracles differentiate something other than
    the expression the hand-derived backward was written against. A quantized head: the
    training step's slice by slice forward (no [chunk, V] Concat and log-softmax beside the
    slices' logits), checked against this one on the dense head (tests/test_qlora_embeddings.py)."""
    if hasattr(head, "row_slice"):
        return sliced_ce_forward(g, h, head, safe, weight, softcap, slices)[0]
    logp = g.op("LogSoftmax", logits_forward(g, h, head, softcap, slices), axis=-1)
    return g.reduce_sum(g.op("Mul", g.op("Neg", g.op("GatherElements", logp, safe, axis=1)), weight), 0, 1)


def loss_only(g, h, head, labels, batch: int, seq: int, chunk: int, softcap: float | None = None, slices: int = 0):
    """Mean masked CE without the gradient (eval) -> loss [1, 1]."""
    safe, weight = shifted_targets(g, labels, batch, seq)
    return _sum(g, [ce_loss(g, pick(h), head, pick(safe), pick(weight), softcap, slices)
                    for pick in _chunks(g, batch * seq, chunk)])
