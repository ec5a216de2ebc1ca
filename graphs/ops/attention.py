"""Grouped-query causal attention as two units (lorac.CausalAttention, .CausalAttentionGrad).

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

Two variants (Gemma 2, Phi-3, Mistral past its window) are units of their own names, which
the CUDA build inlines (cuDNN's SDPA is not asked for them; docs/COMPILER.md):
- soft-capping: scores c * tanh(s / c) before the mask (`softcap` c),
- a sliding window: query i sees keys j with i - window < j <= i (HF's sliding-window
  mask), applied only when the window is shorter than the sequence.

Packed rows (`--packing isolated`, docs/DATA.md): the packed units ("Packed" before the
name) take the rows' position ids pos [B, S] (int64 or int32; the mask is computed in int32) before the scale, numbered 0, 1, ...
from each document's start as HF's padding-free collator does. A query at index i with
position p = pos[b, i] began its document at index i - p, so it sees exactly the keys j
with i - p <= j <= i: causal AND same document (a block-diagonal causal mask), with no
document ids needed. Only the mask differs, so the forward and backward bodies are the
same (a masked score is -1e30 and its probability exactly 0 in both); every query sees at
least itself, so no softmax row is empty. The CUDA bf16 build maps the plain packed units
to cuDNN's SDPA, each document a sequence of its ragged layout (docs/COMPILER.md).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ..builder import INT32

MASKED = -1e30  # finite: exp underflows to exactly 0, and no inf-inf NaNs in any dtype


@dataclass(frozen=True)
class Mask:
    """What the scores see besides q k^T: a tanh soft-cap and a sliding window (None: neither),
    and whether rows are packed documents (the unit then takes position ids)."""
    softcap: float | None = None
    window: int | None = None
    packed: bool = False

    def unit(self, seq: int) -> str:
        """The unit's name: plain causal attention (packed or not) is what cuDNN runs on CUDA."""
        return (("Packed" if self.packed else "") + "CausalAttention" + ("Softcap" if self.softcap else "")
                + ("Window" if self.windowed(seq) else ""))

    def windowed(self, seq: int) -> bool:
        return self.window is not None and self.window < seq


def _variant(dims, np_float, mask: Mask) -> str:
    B, K, G, S, Dh = dims
    extra = (f" softcap={mask.softcap}" if mask.softcap else "") + (f" window={mask.window}" if mask.windowed(S) else "")
    return f"B={B} S={S} K={K} G={G} Dh={Dh} {np.dtype(np_float).name}{extra}"


@dataclass
class AttentionSaved:
    """What the backward unit reads: the unit's inputs, its output and the row log-sum-exp."""
    q: object
    k: object
    v: object
    o: object
    lse: object
    scale: object
    mask: Mask
    positions: object = None  # packed rows: the position ids [B, S]


def attention_forward(g, q, k, v, dims, scale: float | None = None, mask: Mask = Mask(), positions=None):
    """(o [B, S, H, Dh], saved for the backward). `positions` [B, S] (integers): packed rows, each
    query attends only within its own document (the packed units)."""
    s = attention_saved(g, q, k, v, None, None, dims, scale, mask, positions)
    mask = s.mask
    if positions is not None:
        body = lambda fb, q_, k_, v_, pos, c_: _forward_body(fb, q_, k_, v_, c_, dims, mask, pos)
    else:
        body = lambda fb, *x: _forward_body(fb, *x, dims, mask)
    ins = [q, k, v] + ([positions] if positions is not None else []) + [s.scale]
    s.o, s.lse = g.call(mask.unit(dims[3]), _variant(dims, g.np_float, mask), ins, 2, body)
    return s.o, s


def attention_saved(g, q, k, v, o, lse, dims, scale: float | None = None, mask: Mask = Mask(), positions=None):
    """The AttentionSaved of a call on q, k, v with output o and statistics lse: the forward's, or
    one rebuilt from copies (a checkpointed layer whose attention state waited in host memory)."""
    scale = dims[4] ** -0.5 if scale is None else scale
    mask = replace(mask, packed=True) if positions is not None else mask
    return AttentionSaved(q, k, v, o, lse, g.f(scale), mask, positions)


def attention_backward(g, do, saved: AttentionSaved, dims):
    """do = dLoss/do [B, S, H, Dh] -> (dq, dk, dv) in the layouts of q, k, v."""
    s, mask = saved, saved.mask
    if s.positions is not None:
        ins = [s.q, s.k, s.v, s.o, do, s.lse, s.positions, s.scale]
        body = lambda fb, q, k, v, o, do_, lse, pos, c: _backward_body(fb, q, k, v, o, do_, lse, c, dims, mask, pos)
    else:
        ins = [s.q, s.k, s.v, s.o, do, s.lse, s.scale]
        body = lambda fb, *x: _backward_body(fb, *x, dims, mask)
    return g.call(mask.unit(dims[3]) + "Grad", _variant(dims, g.np_float, mask), ins, 3, body)


# -- the unit bodies (default-domain ONNX) ------------------------------------------------
def _grouped(fb, x, dims):
    """[B, S, H, Dh] -> [B, K, G*S, Dh] (heads first, each kv head's G query heads stacked)."""
    B, K, G, S, Dh = dims
    return fb.reshape(fb.transpose(x, 0, 2, 1, 3), B, K, G * S, Dh)


def _ungrouped(fb, x, dims, heads):
    """[B, heads', rows, Dh] -> [B, S, heads, Dh] (the inverse of _grouped)."""
    B, K, G, S, Dh = dims
    return fb.transpose(fb.reshape(x, B, heads, S, Dh), 0, 2, 1, 3)


def _masked_scores(fb, q, k, scale, dims, mask: Mask, positions=None):
    """(scores [B, K, G, S, S] (times `scale`, unless None) with -1e30 where key j is not seen by
    query i, t = tanh(s/c) before masking or None without a soft-cap). Seen: j <= i, and
    i - j < window if any, and with `positions` [B, S] j >= i - positions[i] (the query's document)."""
    B, K, G, S, Dh = dims
    s = fb.matmul(_grouped(fb, q, dims), fb.transpose(k, 0, 2, 3, 1))  # [B, K, G*S, S]
    s = fb.reshape(s if scale is None else fb.op("Mul", s, scale), B, K, G, S, S)
    t = None
    if mask.softcap:  # s <- c tanh(s / c), as HF's eager attention does before the mask
        t = fb.op("Tanh", fb.op("Mul", s, fb.f(1.0 / mask.softcap)))
        s = fb.op("Mul", t, fb.f(mask.softcap))
    pos = fb.op("Range", fb.const(np.int32(0)), fb.const(np.int32(S)), fb.const(np.int32(1)))  # int32, as positions
    j, i = fb.op("Unsqueeze", pos, fb.ints(0)), fb.op("Unsqueeze", pos, fb.ints(1))
    seen = fb.op("LessOrEqual", j, i)
    if mask.windowed(S):
        seen = fb.op("And", seen, fb.op("Greater", j, fb.op("Sub", i, fb.const(np.int32(mask.window)))))
    if positions is not None:  # i - j <= positions[b, i]: the key lies in the query's document; [B, 1, 1, S, S]
        back = fb.op("Sub", i, j)
        pos32 = fb.op("Cast", positions, to=INT32)  # int32 mask math: WebGPU has no 64-bit integers
        seen = fb.op("And", seen, fb.op("LessOrEqual", back, fb.op("Unsqueeze", pos32, fb.ints(1, 2, 4))))
    return fb.op("Where", seen, s, fb.f(MASKED)), t


def _forward_body(fb, q, k, v, scale, dims, mask: Mask, positions=None):
    B, K, G, S, Dh = dims
    # p = softmax(s); lse = m + log(sum exp(s - m)) with m the row max, so p = exp(s - lse).
    # lse feeds only the backward unit: autodiff tools differentiating o see plain Softmax
    s, _ = _masked_scores(fb, q, k, scale, dims, mask, positions)
    p = fb.reshape(fb.op("Softmax", s, axis=-1), B, K, G * S, S)
    o = _ungrouped(fb, fb.matmul(p, fb.transpose(v, 0, 2, 1, 3)), dims, K * G)
    m = fb.op("ReduceMax", s, fb.ints(-1), keepdims=1)
    total = fb.reduce_sum(fb.op("Exp", fb.op("Sub", s, m)), -1)
    lse = fb.reshape(fb.op("Add", m, fb.op("Log", total)), B, K * G, S, 1)
    return o, lse


def _backward_body(fb, q, k, v, o, do, lse, scale, dims, mask: Mask, positions=None):
    B, K, G, S, Dh = dims
    # p recomputed from lse; masked entries give exp(-1e30 - lse) = 0 exactly
    s, t = _masked_scores(fb, q, k, scale, dims, mask, positions)
    p = fb.op("Exp", fb.op("Sub", s, fb.reshape(lse, B, K, G, S, 1)))
    p4 = fb.reshape(p, B, K, G * S, S)
    dog = _grouped(fb, do, dims)
    # o = p v: dv = p^T do (the matmul sums the G query heads of each kv head), dp = do v^T
    dv = fb.matmul(fb.transpose(p4, 0, 1, 3, 2), dog)
    dp = fb.reshape(fb.matmul(dog, fb.transpose(v, 0, 2, 3, 1)), B, K, G, S, S)
    # softmax: ds = p * (dp - sum_j p dp), and sum_j p_ij dp_ij = do_i . o_i (rowsum D)
    rowsum = fb.reshape(fb.transpose(fb.reduce_sum(fb.op("Mul", do, o), -1), 0, 2, 1, 3), B, K, G, S, 1)
    ds = fb.op("Mul", p, fb.op("Sub", dp, rowsum))
    if t is not None:  # soft-cap c tanh(x / c): d/dx = 1 - t^2 (t from the unmasked scores; ds is 0 where masked)
        ds = fb.op("Mul", ds, fb.op("Sub", fb.f(1.0), fb.op("Mul", t, t)))
    ds = fb.reshape(fb.op("Mul", ds, scale), B, K, G * S, S)
    # s = c q k^T: dq = ds k, dk = ds^T q
    dq = fb.matmul(ds, fb.transpose(k, 0, 2, 1, 3))
    dk = fb.matmul(fb.transpose(ds, 0, 1, 3, 2), _grouped(fb, q, dims))
    return _ungrouped(fb, dq, dims, K * G), _ungrouped(fb, dk, dims, K), _ungrouped(fb, dv, dims, K)
