"""Oracle 1: central finite differences in float64 on every op family's backward emitter.

Each check builds a float64 graph y = forward(x...), feeds a random cotangent dy and
compares the emitted backward with (L(x + e v) - L(x - e v)) / 2e for L = sum(y * dy),
along random directions v, per input.
"""
import numpy as np
import pytest

from lorac.graphs.ops.attention import Mask, attention_backward, attention_forward
from lorac.graphs.builder import INT64, GraphBuilder
from lorac.graphs.ops.linear import Proj, linear_backward, linear_forward, linear_group_forward
from lorac.graphs.ops.loss import loss_and_grad
from lorac.graphs.ops.mlp import geglu_backward, geglu_forward, swiglu_backward, swiglu_forward
from lorac.graphs.ops.norm import rmsnorm_backward, rmsnorm_forward
from lorac.graphs.ops.rope import rope_backward, rope_forward, rope_tables
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


@pytest.mark.parametrize("S,Dh,token_major", [(5, 4, False), (3, 10, True)])
def test_rope(S, Dh, token_major):
    cos, sin = rope_tables(S, Dh, 1000.0)
    shape = (2, S, 3, Dh) if token_major else (2, 3, S, Dh)
    if token_major:  # the decoder's layout: tables broadcast over the heads axis
        cos, sin = cos[:, None, :], sin[:, None, :]
    def emit(g, x):
        c, s = g.fconst(cos), g.fconst(sin)
        return rope_forward(g, x["x"], c, s, Dh), {"x": rope_backward(g, _dy(g, shape), c, s, Dh)}
    fd_check({"x": shape}, emit)


@pytest.mark.parametrize("B,K,G,S,Dh", [(1, 1, 1, 4, 3), (2, 2, 3, 5, 4), (1, 3, 2, 7, 2)])
def test_attention(B, K, G, S, Dh):
    """The two units (forward and its backward), run through onnxruntime's inlining."""
    dims = (B, K, G, S, Dh)
    def emit(g, x):
        ctx, saved = attention_forward(g, x["q"], x["k"], x["v"], dims)
        dq, dk, dv = attention_backward(g, _dy(g, (B, S, K * G, Dh)), saved, dims)
        return ctx, {"q": dq, "k": dk, "v": dv}
    fd_check({"q": (B, S, K * G, Dh), "k": (B, S, K, Dh), "v": (B, S, K, Dh)}, emit)


@pytest.mark.parametrize("dims,mask", [((1, 2, 2, 5, 3), Mask(softcap=0.7)), ((2, 1, 3, 7, 4), Mask(window=3)),
                                       ((1, 2, 1, 6, 2), Mask(softcap=1.3, window=2))])
def test_attention_softcap_and_window(dims, mask):
    """The soft-capped and windowed units (Gemma 2, Phi-3, Mistral past its window)."""
    B, K, G, S, Dh = dims
    def emit(g, x):
        ctx, saved = attention_forward(g, x["q"], x["k"], x["v"], dims, scale=0.8, mask=mask)
        dq, dk, dv = attention_backward(g, _dy(g, (B, S, K * G, Dh)), saved, dims)
        return ctx, {"q": dq, "k": dk, "v": dv}
    fd_check({"q": (B, S, K * G, Dh), "k": (B, S, K, Dh), "v": (B, S, K, Dh)}, emit)


def test_attention_window_and_softcap_values():
    """Against numpy: query i sees keys i - window < j <= i, scores c tanh(s / c)."""
    B, K, G, S, Dh, W, c = 1, 2, 2, 6, 3, 3, 0.9
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((B, S, n, Dh)) for n in (K * G, K, K))
    g = GraphBuilder("win", np.float64)
    xs = [g.input(n, a.shape) for n, a in zip("qkv", (q, k, v))]
    o, _ = attention_forward(g, *xs, (B, K, G, S, Dh), scale=0.5, mask=Mask(softcap=c, window=W))
    g.output(o, "o")
    model = g.finish()
    assert {f.name for f in model.functions} == {"CausalAttentionSoftcapWindow"}
    kk, vv = np.repeat(k, G, axis=2), np.repeat(v, G, axis=2)
    s = c * np.tanh(np.einsum("bihd,bjhd->bhij", q, kk) * 0.5 / c)
    i, j = np.arange(S)[:, None], np.arange(S)[None, :]
    s = np.where((j <= i) & (j > i - W), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    np.testing.assert_allclose(run_ort(model, dict(q=q, k=k, v=v))["o"], np.einsum("bhij,bjhd->bihd", p, vv),
                               rtol=1e-10)


def test_attention_lse():
    """The forward unit's second output is each softmax row's log-sum-exp (what cuDNN's
    SDPA calls its stats), checked against numpy in float64."""
    B, K, G, S, Dh = 2, 2, 3, 5, 4
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((B, S, n, Dh)) for n in (K * G, K, K))
    g = GraphBuilder("lse", np.float64)
    xs = [g.input(n, a.shape) for n, a in zip("qkv", (q, k, v))]
    o, saved = attention_forward(g, *xs, (B, K, G, S, Dh), scale=0.25)
    g.output(o, "o")
    g.output(saved.lse, "lse")
    out = run_ort(g.finish(), dict(q=q, k=k, v=v))
    kk, vv = np.repeat(k, G, axis=2), np.repeat(v, G, axis=2)  # HF repeat_kv
    s = np.einsum("bihd,bjhd->bhij", q, kk) * 0.25
    s = np.where(np.tril(np.ones((S, S), bool)), s, -np.inf)
    lse = np.log(np.exp(s).sum(-1, keepdims=True))
    np.testing.assert_allclose(out["lse"], lse, rtol=1e-12)
    np.testing.assert_allclose(out["o"], np.einsum("bhij,bjhd->bihd", np.exp(s - lse), vv), rtol=1e-10)


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


@pytest.mark.parametrize("adapted", [(True, False, True), (True, True, True), (False, True, False)])
def test_linear_group(adapted):
    """Projections sharing one input (q/k/v): the adapted ones' A in one GEMM (each backward
    reads its slice of u), also with a frozen one in between and with one adapted alone."""
    N, i, r, outs = 5, 6, 2, (7, 3, 4)
    shapes = {"x": (N, i)}
    for j, (o, ad) in enumerate(zip(outs, adapted)):
        shapes[f"w{j}"], shapes[f"bias{j}"] = (o, i), (o,)
        if ad:
            shapes[f"a{j}"], shapes[f"b{j}"] = (r, i), (o, r)
    def emit(g, x):
        projs = [Proj(x[f"w{j}"], x[f"bias{j}"], x.get(f"a{j}"), x.get(f"b{j}"), 0.7 if ad else 0.0)
                 for j, ad in enumerate(adapted)]
        ys, us = linear_group_forward(g, x["x"], projs)
        dy, cuts = _dy(g, (N, sum(outs))), np.cumsum((0,) + outs)
        dys = [g.slice(dy, int(lo), int(hi), 1) for lo, hi in zip(cuts, cuts[1:])]
        back = [linear_backward(g, d, x["x"], u, p) for d, u, p in zip(dys, us, projs)]
        grads = {"x": g.add_all(*[b[0] for b in back])}
        for j, (_, da, db) in enumerate(back):
            if da is not None:
                grads[f"a{j}"], grads[f"b{j}"] = da, db
        # one output: the outputs concatenated, so each dy_j is a block of the check's dy
        return g.op("Concat", *ys, axis=1), grads
    fd_check(shapes, emit)


def test_swiglu():
    shape = (4, 9)
    def emit(g, x):
        y = swiglu_forward(g, x["gate"], x["up"])
        dgate, dup = swiglu_backward(g, _dy(g, shape), x["gate"], x["up"])
        return y, {"gate": dgate, "up": dup}
    fd_check({"gate": shape, "up": shape}, emit)


def test_geglu():
    shape = (4, 9)
    def emit(g, x):
        y = geglu_forward(g, x["gate"], x["up"])
        dgate, dup = geglu_backward(g, _dy(g, shape), x["gate"], x["up"])
        return y, {"gate": dgate, "up": dup}
    fd_check({"gate": shape, "up": shape}, emit)


def test_geglu_is_torch_gelu_tanh():
    torch = pytest.importorskip("torch")
    x = np.linspace(-6, 6, 41)
    g = GraphBuilder("gelu", np.float64)
    xs = g.input("x", x.shape)
    g.output(geglu_forward(g, xs, g.fconst(np.ones_like(x))), "y")
    want = torch.nn.functional.gelu(torch.from_numpy(x), approximate="tanh").numpy()
    np.testing.assert_allclose(run_ort(g.finish(), {"x": x})["y"], want, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("chunk,softcap", [(0, None), (4, None), (0, 1.5), (4, 0.8)])
def test_cross_entropy(chunk, softcap):
    B, S, D, V = 2, 5, 4, 11
    labels = np.random.default_rng(3).integers(0, V, (B, S)).astype(np.int64)
    labels[0, 2] = labels[1, 4] = -100
    def emit(g, x):
        loss, dh = loss_and_grad(g, x["h"], x["head"], x["labels"], B, S, V, chunk, softcap)
        return g.reshape(loss), {"h": dh}
    fd_check({"h": (B * S, D), "head": (V, D)}, emit, extra_feeds={"labels": (labels, INT64)}, scalar_out=True)
