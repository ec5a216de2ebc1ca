"""Oracle 1 for the Mamba-1 family: float64 finite differences on the causal conv, the chunked
selective scan (chunk lengths that do and do not divide seq, one chunk, chunk 1), one whole
block with LoRA on all four projections, and a whole tiny model. Plus the scan's forward
against the step-by-step recurrence, and its stability where exp(+lam) would overflow."""
import numpy as np
import pytest

from lorac.graphs.builder import GraphBuilder
from lorac.graphs.ops.conv import conv_backward, conv_forward
from lorac.graphs.ops.linear import Proj
from lorac.graphs.mamba import Ctx, MambaLayer, layer_backward, layer_forward
from lorac.graphs.mamba_spec import MambaSpec
from lorac.graphs.ops.scan import ScanDims, scan_backward, scan_forward
from lorac.graphs.spec import TrainSpec
from mamba_oracles import scan_reference
from oracles import directional_fd, run_ort
from test_graph_ops_fd import fd_check


@pytest.mark.parametrize("K", [1, 3, 4])
def test_conv(K):
    B, S, I = 2, 6, 5
    def emit(g, x):
        y = conv_forward(g, x["x"], x["w"], x["bias"], S, I, K)
        return y, {"x": conv_backward(g, g.input("dy", (B, S, I)), x["w"], S, I, K)}
    fd_check({"x": (B, S, I), "w": (I, 1, K), "bias": (I,)}, emit)


def _scan_inputs(g, x):
    """Raw standard-normal feeds -> valid scan inputs: dt = softplus(dt_raw) > 0, A = -exp(A_log) < 0."""
    dt = g.op("Softplus", x["dt"])
    return dt, g.op("Neg", g.op("Exp", x["A_log"]))


@pytest.mark.parametrize("B,S,I,M,L", [(2, 7, 3, 4, 3), (1, 9, 2, 3, 4), (2, 5, 3, 2, 5), (1, 6, 2, 2, 1),
                                       (1, 11, 2, 3, 2)])
def test_scan(B, S, I, M, L):
    d = ScanDims(B, S, I, M, L)
    def emit(g, x):
        dt, A = _scan_inputs(g, x)
        y, h0 = scan_forward(g, x["u"], dt, A, x["Bm"], x["Cm"], x["D"], d)
        du, ddt, dB, dC = scan_backward(g, g.input("dy", (B, S, I)), x["u"], dt, A, x["Bm"], x["Cm"], x["D"], h0, d)
        return y, {"u": du, "dt": g.op("Mul", ddt, g.op("Sigmoid", x["dt"])), "Bm": dB, "Cm": dC}
    fd_check({"u": (B, S, I), "dt": (B, S, I), "A_log": (I, M), "Bm": (B, S, M), "Cm": (B, S, M), "D": (I,)}, emit)


def _scan_model(d: ScanDims, dtype=np.float64):
    g = GraphBuilder("scan", dtype)
    x = {n: g.input(n, s) for n, s in (("u", (d.batch, d.seq, d.channels)), ("dt", (d.batch, d.seq, d.channels)),
                                        ("A", (d.channels, d.state)), ("Bm", (d.batch, d.seq, d.state)),
                                        ("Cm", (d.batch, d.seq, d.state)), ("D", (d.channels,)))}
    y, h0 = scan_forward(g, x["u"], x["dt"], x["A"], x["Bm"], x["Cm"], x["D"], d)
    g.output(y, "y")
    grads = scan_backward(g, g.input("dy", (d.batch, d.seq, d.channels)), x["u"], x["dt"], x["A"], x["Bm"],
                          x["Cm"], x["D"], h0, d)
    for n, v in zip(("du", "ddt", "dBm", "dCm"), grads):
        g.output(v, n)
    return g.finish()


@pytest.mark.parametrize("L", [1, 3, 4, 10])
def test_scan_forward_is_the_recurrence(L):
    d = ScanDims(2, 10, 3, 4, L)
    rng = np.random.default_rng(5)
    f = dict(u=rng.standard_normal((2, 10, 3)), dt=rng.random((2, 10, 3)), A=-np.exp(rng.standard_normal((3, 4))),
             Bm=rng.standard_normal((2, 10, 4)), Cm=rng.standard_normal((2, 10, 4)), D=rng.standard_normal(3),
             dy=rng.standard_normal((2, 10, 3)))
    out = run_ort(_scan_model(d), f)
    ref = scan_reference(f["u"], f["dt"], f["A"], f["Bm"], f["Cm"], f["D"])
    assert np.abs(out["y"] - ref).max() <= 1e-12 * max(1.0, np.abs(ref).max())


def test_scan_is_stable_where_exp_of_minus_cumsum_overflows():
    """dt*|A| summed over a chunk reaches ~1e4: exp(-lam) would be inf even in float64."""
    d = ScanDims(1, 40, 2, 3, 16)
    rng = np.random.default_rng(6)
    f = dict(u=rng.standard_normal((1, 40, 2)), dt=20 * rng.random((1, 40, 2)), A=-np.full((2, 3), 30.0),
             Bm=rng.standard_normal((1, 40, 3)), Cm=rng.standard_normal((1, 40, 3)), D=np.ones(2),
             dy=rng.standard_normal((1, 40, 2)))
    f32 = {k: v.astype(np.float32) for k, v in f.items()}
    g = _scan_model(d, np.float32)
    out = run_ort(g, f32)
    assert all(np.isfinite(v).all() for v in out.values())
    ref = scan_reference(f["u"], f32["dt"].astype(np.float64), f["A"], f["Bm"], f["Cm"], f["D"])
    assert np.abs(out["y"] - ref).max() <= 1e-4 * np.abs(ref).max()


def _block_spec(conv_bias, use_bias):
    return MambaSpec(vocab=7, hidden=5, layers=1, state=3, intermediate=6, conv_kernel=3, dt_rank=2,
                     use_bias=use_bias, conv_bias=conv_bias)


@pytest.mark.parametrize("S,L,conv_bias,use_bias", [(7, 3, True, False), (5, 2, False, True)])
def test_block(S, L, conv_bias, use_bias):
    spec, B, r = _block_spec(conv_bias, use_bias), 2, 2
    train = TrainSpec(batch=B, seq=S, lora_targets=spec.targets, rank=r, alpha=2.0, extra={"scan_chunk": L})
    D, I = spec.hidden, spec.intermediate
    shapes = {"x": (B * S, D), "norm": (D,), "conv_w": (I, 1, 3), "A_log": (I, spec.state), "D": (I,), "dt_bias": (I,)}
    if conv_bias:
        shapes["conv_b"] = (I,)
    if use_bias:
        shapes.update(in_bias=(2 * I,), out_bias=(D,))
    for t in spec.targets:
        o, i = spec.proj_shape(t)
        shapes.update({f"{t}.w": (o, i), f"{t}.a": (r, i), f"{t}.b": (o, r)})

    def emit(g, x):
        # frozen weights scaled by 1/sqrt(fan-in) inside the graph (they get no gradient), so
        # activations stay O(1) and the finite differences stay accurate
        def proj(t, bias=None):
            o, i = spec.proj_shape(t)
            return Proj(g.op("Mul", x[f"{t}.w"], g.f(i ** -0.5)), bias, x[f"{t}.a"], x[f"{t}.b"], 0.3)
        L_ = MambaLayer(0, x["norm"], x["conv_w"], x.get("conv_b"), x["A_log"], x["D"],
                        {"in_proj": proj("in_proj", x.get("in_bias")), "x_proj": proj("x_proj"),
                         "dt_proj": proj("dt_proj", x["dt_bias"]), "out_proj": proj("out_proj", x.get("out_bias"))})
        c = Ctx(g, spec, train)
        y, s = layer_forward(c, x["x"], L_)
        grads = {}
        dx = layer_backward(c, g.input("dy", (B * S, D)), L_, s, need_dx=True, grads=grads)
        out = {"x": dx}
        for t in spec.targets:
            out[f"{t}.a"] = grads[f"base_model.model.backbone.layers.0.mixer.{t}.lora_A.weight"]
            out[f"{t}.b"] = grads[f"base_model.model.backbone.layers.0.mixer.{t}.lora_B.weight"]
        return y, out
    fd_check(shapes, emit)


def test_whole_model_finite_differences_float64():
    from lorac.graphs import build_eval_graph, build_training_graph
    from test_mamba_parity import feeds
    cfg = dict(model_type="mamba", vocab_size=23, hidden_size=7, state_size=3, num_hidden_layers=2, expand=2,
               conv_kernel=3, tie_word_embeddings=False)
    spec = MambaSpec.from_hf_config(cfg)
    train = TrainSpec(batch=2, seq=7, lora_targets=spec.targets, rank=2, alpha=4, extra={"scan_chunk": 3})
    f = {k: (v.astype(np.float64) if v.dtype == np.float32 else v) for k, v in feeds(cfg, spec, train).items()}
    out = run_ort(build_training_graph(spec, train, dtype="float64"), f)
    loss_model = build_eval_graph(spec, train, dtype="float64")
    rng, eps = np.random.default_rng(7), 1e-6
    for gname in sorted(k for k in out if k.endswith(".grad")):
        fd, an = directional_fd(loss_model, f, out, gname, rng, eps)
        assert abs(fd - an) <= 1e-6 * max(1.0, abs(fd)), (gname, fd, an)
