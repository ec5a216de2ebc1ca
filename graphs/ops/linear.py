"""Linear layer with an optional bias and an optional LoRA adapter, forward and backward.

Shapes: x [N, in], W [out, in] (HF layout), bias [out], A [r, in], B [out, r], s the scale.
y = x W^T + bias + s (x A^T) B^T. W and bias are frozen; only A and B get gradients.
W may arrive quantized (TrainSpec.quant): then it is a graphs.quant.QuantWeight, and every
read of it (the forward's GEMM, the backward's dx = dy W, a checkpointed layer's recompute)
emits its own dequantization, so no dense copy of W outlives the GEMM that reads it.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Proj:
    """The graph values of one projection: frozen weight/bias and, if adapted, LoRA A/B."""
    w: object
    bias: object = None
    a: object = None
    b: object = None
    scale: float = 0.0


def frozen_weight(g, train, name: str, out: int, inp: int):
    """The graph input(s) of frozen weight `name` [out, in]: dense, or the blocks of its
    quantized form where TrainSpec.quant names it."""
    q = train.quant_of(name)
    if q is None:
        return g.input(name, [out, inp])
    from .quant import declare
    return declare(g, q, name, out, inp)


def weight(g, p: Proj):
    """W as a dense value for one GEMM: the input itself, or a fresh dequantization."""
    return p.w.dense(g) if hasattr(p.w, "dense") else p.w


def gather_rows(g, table, ids, n: int, width: int):
    """Rows of a frozen [V, width] table (an embedding) for the n int ids -> [n, width]: a Gather,
    or, where the table is quantized, the dequantization of those rows alone (QuantWeight.rows)."""
    if hasattr(table, "rows"):
        return table.rows(g, ids, n)
    return g.reshape(g.op("Gather", table, ids, axis=0), n, width)


def add_lora(g, p: Proj, names, train, out: int, inp: int) -> None:
    """Adapt projection `p`: LoRA inputs A [r, in] and B [out, r], named names("A") / names("B")."""
    p.a = g.input(names("A"), [train.rank, inp])
    p.b = g.input(names("B"), [out, train.rank])
    p.scale = train.scale


def linear_forward(g, x, p: Proj):
    y = g.mm_t(x, weight(g, p))
    if p.bias is not None:
        y = g.op("Add", y, p.bias)
    if p.a is None:
        return y, None
    # u = s * x A^T is kept for dB; s folded into the small [N, r] tensor
    u = g.op("Mul", g.mm_t(x, p.a), g.f(p.scale))
    return g.op("Add", y, g.mm_t(u, p.b)), u


def linear_backward(g, dy, x, u, p: Proj, need_dx: bool = True):
    """Returns (dx or None, dA or None, dB or None). `x` is the projection's input, or a
    function of dx that returns it (a lean layer forms down_proj's input in the unit that
    takes dx: decoder.gated_mlp_backward). `u` None for an adapted projection: s x A^T is
    formed here from x (a recomputed layer skips down_proj's forward: decoder.layer_forward)."""
    da = db = dx = du = None
    if p.a is not None:
        # dB = dy^T u = s dy^T (x A^T); du = s dy B; dA = du^T x
        if u is not None:
            db = g.matmul(g.transpose(dy, 1, 0), u)
        du = g.op("Mul", g.matmul(dy, p.b), g.f(p.scale))
    if need_dx:
        # dx = dy W + du A
        dx = g.matmul(dy, weight(g, p))
        if p.a is not None:
            dx = g.op("Add", dx, g.matmul(du, p.a))
    if callable(x):
        x = x(dx)
    if p.a is not None:
        if u is None:
            db = g.matmul(g.transpose(dy, 1, 0), g.op("Mul", g.mm_t(x, p.a), g.f(p.scale)))
        da = g.matmul(g.transpose(du, 1, 0), x)
    return dx, da, db


def projection_backward(g, grads: dict, names, dy, x, u, p: Proj, need_dx: bool = True):
    """linear_backward of one projection of a layer, its LoRA gradients (if it is adapted)
    stored in `grads` under `names` = (A's name, B's name) -> dx or None."""
    dx, da, db = linear_backward(g, dy, x, u, p, need_dx)
    if da is not None:
        grads[names[0]], grads[names[1]] = da, db
    return dx


def group_backward(g, grads: dict, names: list, dys: list, x, us: list, projs: list, need_dx: bool = True):
    """projection_backward of projections that read the same x (q/k/v; gate/up), their input
    gradients summed -> dx or None. Each adapted one's dB = dy^T u, du = s dy B and dA = du^T x as
    alone, but their du side by side [N, k r] meet their A's concatenated [k r, in] (as the
    forward's lora_inputs) in one GEMM for dx's LoRA term: one pass over dx where each projection
    wrote or added its own (a rank-r GEMM is bound by the [N, in] output it writes: at
    Llama-3-8B's 8192 tokens q/k/v's three took 0.21 ms a layer on an H100, one takes 0.05).
    dA stays one GEMM a projection: rows sliced from a joined [k r, in] gradient would be outputs
    that are slices, which TVM's frontend binds at the end with what they read (the flat LoRA
    gradient's Reshape reads them: graphs/flat_lora.py), and the checkpointed step's plan grew
    twelvefold at Llama-3-8B."""
    lora = [i for i, p in enumerate(projs) if p.a is not None]
    if len(lora) < 2 or callable(x) or any(us[i] is None for i in lora):
        dxs = [projection_backward(g, grads, n, dy, x, u, p, need_dx) for n, dy, u, p in zip(names, dys, us, projs)]
        return g.add_all(*dxs) if need_dx else None
    r, dus, frozen = int(projs[lora[0]].a.shape[0]), [], []
    for n, dy, u, p in zip(names, dys, us, projs):
        if need_dx:
            frozen.append(g.matmul(dy, weight(g, p)))
        if p.a is not None:
            grads[n[1]] = g.matmul(g.transpose(dy, 1, 0), u)
            dus.append(g.matmul(dy, p.b))
    du = g.op("Mul", g.op("Concat", *dus, axis=1), g.f(projs[lora[0]].scale))
    for k, i in enumerate(lora):
        grads[names[i][0]] = g.matmul(g.transpose(g.slice(du, k * r, (k + 1) * r, 1), 1, 0), x)
    if not need_dx:
        return None
    a = g.op("Concat", *[projs[i].a for i in lora], axis=0)
    return g.add_all(g.matmul(du, a), *frozen)


def linear_group_forward(g, x, projs: list):
    """Projections that read the same x (q/k/v; gate/up): each frozen GEMM as linear_forward,
    but the adapted ones' A matrices concatenated into one [k*r, in], so x meets them in one
    GEMM instead of k thin ones. -> (outputs, u per projection or None). The backward is
    linear_backward per projection with its u (a slice of the batched one)."""
    lora = [p for p in projs if p.a is not None]
    if len(lora) < 2:
        outs = [linear_forward(g, x, p) for p in projs]
        return [y for y, _ in outs], [u for _, u in outs]
    us = lora_inputs(g, x, projs)
    ys = []
    for p, u in zip(projs, us):
        y = g.mm_t(x, weight(g, p))
        if p.bias is not None:
            y = g.op("Add", y, p.bias)
        if u is not None:  # y += u_i B_i^T, u_i the i-th adapted block of the batched u
            y = g.op("Add", y, g.mm_t(u, p.b))
        ys.append(y)
    return ys, us


def lora_inputs(g, x, projs: list) -> list:
    """u = s x A^T of each projection of `projs` that reads x (None where not adapted), without
    their frozen GEMMs: the adapted ones' A matrices in one GEMM where there are several."""
    lora = [p for p in projs if p.a is not None]
    if len(lora) < 2:
        return [g.op("Mul", g.mm_t(x, p.a), g.f(p.scale)) if p.a is not None else None for p in projs]
    r = int(lora[0].a.shape[0])
    u_all = g.op("Mul", g.mm_t(x, g.op("Concat", *[p.a for p in lora], axis=0)), g.f(lora[0].scale))
    us, i = [], 0
    for p in projs:
        us.append(None if p.a is None else g.slice(u_all, i * r, (i + 1) * r, 1))
        i += p.a is not None
    return us
