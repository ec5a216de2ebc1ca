"""Oracle 1: central finite differences in float64 on every op family's backward emitter.

Each check builds a float64 graph y = forward(x...), feeds a random cotangent dy and
compares the emitted backward with (L(x + e v) - L(x - e v)) / 2e for L = sum(y * dy),
along random directions v, per input.
"""
import numpy as np
import pytest

from lorac.graphs.attention import attention_backward, attention_forward, causal_mask
from lorac.graphs.builder import INT64, GraphBuilder
from lorac.graphs.linear import Proj, linear_backward, linear_forward
from lorac.graphs.loss import loss_and_grad
from lorac.graphs.mlp import swiglu_backward, swiglu_forward
from lorac.graphs.norm import rmsnorm_backward, rmsnorm_forward
from lorac.graphs.rope import rope_backward, rope_forward, rope_tables
from oracles import run_ort

EPS = 1e-6


def fd_check(shapes: dict, emit, seed=0, extra_feeds=None, scalar_out=False):
    """emit(g, xs: dict of values, dy) -> (y, {input name: dx value}); dy absent if scalar_out."""
    rng = np.random.default_rng(seed)
    g = GraphBuilder("fd", np.float64)
    xs = {n: g.input(n, s) for n, s in shapes.items()}
    for n, (arr, dt) in (extra_feeds or {}).items():
        xs[n] = g.input(n, arr.shape, dt)
    y, grads = emit(g, xs)
    y_shape = None
    g.output(y, "y")
    for n, d in grads.items():
        g.output(d, n + ".d")
    model = g.finish()
    y_shape = [d.dim_value for d in model.graph.output[0].type.tensor_type.shape.dim]
    dy = rng.standard_normal(y_shape)
    feeds = {n: rng.standard_normal(s) for n, s in shapes.items()}
    feeds.update({n: arr for n, (arr, _) in (extra_feeds or {}).items()})
    if not scalar_out:
        feeds["dy"] = dy
    out = run_ort(model, feeds)

    def L(f):
        yv = run_ort(model, f)["y"]
        return float(np.sum(yv * (1.0 if scalar_out else dy)))

    for n in grads:
        for trial in range(2):
            v = rng.standard_normal(shapes[n])
            plus, minus = dict(feeds), dict(feeds)
            plus[n] = feeds[n] + EPS * v
            minus[n] = feeds[n] - EPS * v
            fd = (L(plus) - L(minus)) / (2 * EPS)
            an = float(np.sum(out[n + ".d"] * v))
            assert abs(fd - an) <= 1e-6 * max(1.0, abs(fd)), (n, fd, an)


def _dy(g, like_shape):
    return g.input("dy", like_shape)


@pytest.mark.parametrize("shape", [(5, 7), (2, 3, 4, 6)])
def test_rmsnorm(shape):
    def emit(g, x):
        y, saved = rmsnorm_forward(g, x["x"], x["w"], 1e-5)
        return y, {"x": rmsnorm_backward(g, _dy(g, shape), x["w"], saved)}
    fd_check({"x": shape, "w": (shape[-1],)}, emit)


@pytest.mark.parametrize("S,Dh", [(5, 4), (3, 10)])
def test_rope(S, Dh):
    cos, sin = rope_tables(S, Dh, 1000.0)
    shape = (2, 3, S, Dh)
    def emit(g, x):
        c, s = g.fconst(cos), g.fconst(sin)
        return rope_forward(g, x["x"], c, s, Dh), {"x": rope_backward(g, _dy(g, shape), c, s, Dh)}
    fd_check({"x": shape}, emit)


@pytest.mark.parametrize("B,K,G,S,Dh", [(1, 1, 1, 4, 3), (2, 2, 3, 5, 4), (1, 3, 2, 7, 2)])
def test_attention(B, K, G, S, Dh):
    dims = (B, K, G, S, Dh)
    def emit(g, x):
        ctx, saved = attention_forward(g, x["q"], x["k"], x["v"], causal_mask(g, S, G), dims)
        dq, dk, dv = attention_backward(g, _dy(g, (B, K * G, S, Dh)), saved, dims)
        return ctx, {"q": dq, "k": dk, "v": dv}
    fd_check({"q": (B, K * G, S, Dh), "k": (B, K, S, Dh), "v": (B, K, S, Dh)}, emit)


@pytest.mark.parametrize("lora,bias", [(True, False), (True, True), (False, True)])
def test_linear(lora, bias):
    N, i, o, r = 6, 5, 7, 3
    shapes = {"x": (N, i), "w": (o, i)}
    if bias:
        shapes["bias"] = (o,)
    if lora:
        shapes.update(a=(r, i), b=(o, r))
    def emit(g, x):
        p = Proj(x["w"], x.get("bias"), x.get("a"), x.get("b"), 0.7)
        y, u = linear_forward(g, x["x"], p)
        dx, da, db = linear_backward(g, _dy(g, (N, o)), x["x"], u, p)
        grads = {"x": dx}
        if lora:
            grads.update(a=da, b=db)
        return y, grads
    fd_check(shapes, emit)


def test_swiglu():
    shape = (4, 9)
    def emit(g, x):
        y, sg = swiglu_forward(g, x["gate"], x["up"])
        dgate, dup = swiglu_backward(g, _dy(g, shape), x["gate"], x["up"], sg)
        return y, {"gate": dgate, "up": dup}
    fd_check({"gate": shape, "up": shape}, emit)


@pytest.mark.parametrize("chunk", [0, 4])
def test_cross_entropy(chunk):
    B, S, D, V = 2, 5, 4, 11
    labels = np.random.default_rng(3).integers(0, V, (B, S)).astype(np.int64)
    labels[0, 2] = labels[1, 4] = -100
    def emit(g, x):
        loss, dh = loss_and_grad(g, x["h"], x["head"], x["labels"], B, S, V, chunk)
        return g.reshape(loss), {"h": dh}
    fd_check({"h": (B * S, D), "head": (V, D)}, emit, extra_feeds={"labels": (labels, INT64)}, scalar_out=True)
