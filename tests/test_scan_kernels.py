"""Mamba's selective scan on lorac's own TIR kernels (compiler/units/scan_kernels.py, mapped by
compiler/units/scan.py). The CPU kernels, compiled through lorac.compiler like any graph,
against: the units' ONNX bodies (the chunked graph path) run by onnxruntime; float64 central
differences of the step-by-step recurrence; themselves in float64 (central differences of the
compiled forward); bf16 inputs. Shapes with odd seq, seq not a multiple of the chunk, a
single chunk, channels not a multiple of the CPU group, state 16, 8 and 4; the aarch64 build.
The CUDA kernels: their warp reduction run on numpy lanes, and the CUDA build (nvcc). The
whole-model checks (compiled step vs onnxruntime and vs HF autograd) are in
test_mamba_compile.py; the GPU run against the CPU artifact is test_cuda_mamba_matches_cpu."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from lorac.graphs.builder import GraphBuilder
from lorac.graphs.ops.scan import ScanDims, scan_backward, scan_forward
from mamba_oracles import scan_reference
from oracles import run_ort

pytest.importorskip("tvm")

NAMES = ("u", "dt", "A", "Bm", "Cm", "D")
GRADS = ("du", "ddt", "dBm", "dCm")
# (B, S, I, M, L): odd S with a partial last chunk and I = 20 (a CPU group of 16 and a tail
# of 4); M = 8 with S = 33 = 4 chunks of 8 + 1; one chunk (L = S) with I = 5; tiny and odd
SHAPES = [(2, 37, 20, 16, 16), (1, 33, 12, 8, 8), (3, 16, 5, 16, 16), (2, 9, 3, 4, 3)]


def _scan_graph(d: ScanDims, dtype=np.float32):
    """y, hs and the four gradients of one SelectiveScan + SelectiveScanGrad pair."""
    g = GraphBuilder("scan", dtype)
    B, S, I, M = d.batch, d.seq, d.channels, d.state
    shapes = dict(u=(B, S, I), dt=(B, S, I), A=(I, M), Bm=(B, S, M), Cm=(B, S, M), D=(I,))
    x = {n: g.input(n, shapes[n]) for n in NAMES}
    y, hs = scan_forward(g, *(x[n] for n in NAMES), d)
    g.output(y, "y")
    g.output(hs, "hs")
    for name, v in zip(GRADS, scan_backward(g, g.input("dy", (B, S, I)), *(x[n] for n in NAMES), hs, d)):
        g.output(v, name)
    return g.finish()


def _feeds(d: ScanDims, seed=0) -> dict:
    rng = np.random.default_rng(seed)
    B, S, I, M = d.batch, d.seq, d.channels, d.state
    return dict(u=rng.standard_normal((B, S, I)), dt=np.log1p(np.exp(rng.standard_normal((B, S, I)))),
                A=-np.exp(rng.standard_normal((I, M))), Bm=rng.standard_normal((B, S, M)),
                Cm=rng.standard_normal((B, S, M)), D=rng.standard_normal(I), dy=rng.standard_normal((B, S, I)))


def _compiled(d: ScanDims, tmp_path, dtype=np.float32):
    from lorac.compiler import compile_graph
    from lorac.runtime.engine.artifact import load_artifact
    art = compile_graph(_scan_graph(d, dtype), target="cpu", out_dir=tmp_path / f"scan-{np.dtype(dtype).name}")
    assert json.loads((art / "manifest.json").read_text())["units"] == ["SelectiveScan", "SelectiveScanGrad"]
    step = load_artifact(art, "cpu")
    return lambda f: step({k: np.asarray(v, dtype) for k, v in f.items()})


def _rel(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float64) - b).max() / max(np.abs(b).max(), 1e-30))


def _loss(f) -> float:
    """sum(y * dy) through the float64 recurrence: its gradients are what the backward gives."""
    return float(np.sum(scan_reference(*(f[n] for n in NAMES)) * f["dy"]))


@pytest.mark.parametrize("B,S,I,M,L", SHAPES)
def test_cpu_kernels_match_the_graph_path_and_finite_differences(B, S, I, M, L, tmp_path):
    d = ScanDims(B, S, I, M, L)
    f = _feeds(d)
    got = _compiled(d, tmp_path)(f)
    # the units' bodies (the chunked scan in plain ONNX) on onnxruntime, fp32
    want = run_ort(_scan_graph(d), {k: v.astype(np.float32) for k, v in f.items()})
    for name in ("y", "hs", *GRADS):
        assert _rel(got[name], want[name]) <= 1e-5, name
    assert _rel(got["y"], scan_reference(*(f[n] for n in NAMES))) <= 1e-5
    # float64 central differences of the recurrence along random directions
    rng, eps = np.random.default_rng(1), 1e-6
    for name, grad in zip(("u", "dt", "Bm", "Cm"), GRADS):
        for _ in range(2):
            v = rng.standard_normal(f[name].shape)
            plus, minus = dict(f), dict(f)
            plus[name], minus[name] = f[name] + eps * v, f[name] - eps * v
            fd = (_loss(plus) - _loss(minus)) / (2 * eps)
            an = float(np.sum(got[grad].astype(np.float64) * v))
            assert abs(fd - an) <= 1e-5 * max(1.0, abs(fd)), (grad, fd, an)


@pytest.mark.parametrize("B,S,I,M,L", SHAPES[:2])
def test_cpu_kernels_in_float64(B, S, I, M, L, tmp_path):
    """The same kernels built for float64: equal to the float64 bodies to rounding, and their
    gradients are central differences of their own forward."""
    d = ScanDims(B, S, I, M, L)
    f = _feeds(d, seed=3)
    run = _compiled(d, tmp_path, np.float64)
    got, want = run(f), run_ort(_scan_graph(d, np.float64), f)
    for name in ("y", "hs", *GRADS):
        assert _rel(got[name], want[name]) <= 1e-12, name
    rng, eps = np.random.default_rng(4), 1e-6
    loss = lambda x: float(np.sum(run(x)["y"] * f["dy"]))
    for name, grad in zip(("u", "dt", "Bm", "Cm"), GRADS):
        v = rng.standard_normal(f[name].shape)
        plus, minus = dict(f), dict(f)
        plus[name], minus[name] = f[name] + eps * v, f[name] - eps * v
        fd = (loss(plus) - loss(minus)) / (2 * eps)
        assert abs(fd - float(np.sum(got[grad] * v))) <= 1e-8 * max(1.0, abs(fd)), grad


def test_cpu_kernels_with_bf16_inputs():
    """What CUDA bf16 builds feed the kernels (scan_units `narrow`): bf16 u, dt, Bm, Cm, dy;
    states and sums stay fp32. Against the fp32 kernels on the bf16-rounded values (exact up
    to fp32 rounding) and on the original values (the cost of the narrowing)."""
    import ml_dtypes
    import tvm

    from lorac.compiler.units import scan_kernels as sk
    from lorac.compiler.units.scan_cpu import backward_cpu, forward_cpu

    d = ScanDims(2, 37, 20, 16, 16)
    f = _feeds(d, seed=5)
    target = tvm.target.Target({"kind": "llvm"})

    def run(dtype, feeds):
        fwd, bwd = (tvm.compile(tvm.IRModule({"k": make(d, dtype).with_attr("global_symbol", "k")}), target)["k"]
                    for make in (forward_cpu, backward_cpu))
        act = lambda n: tvm.runtime.tensor(feeds[n].astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32))
        out = lambda *s: tvm.runtime.tensor(np.zeros(s, np.float32))
        args = [act("u"), act("dt"), tvm.runtime.tensor(feeds["A"].astype(np.float32)), act("Bm"), act("Cm"),
                tvm.runtime.tensor(feeds["D"].astype(np.float32))]
        B, S, I, M, P = d.batch, d.seq, d.channels, d.state, sk.partials(d, gpu=False)
        y, hs = out(B, S, I), out(B, d.n_chunks, I, M)
        fwd(*args, y, hs)
        grads = [out(B, S, I), out(B, S, I), out(B, P, S, M), out(B, P, S, M)]
        bwd(act("dy"), *args, hs, *grads)
        g = [x.numpy() for x in grads]
        return [y.numpy(), g[0], g[1], g[2].sum(1), g[3].sum(1)]

    rounded = {k: v if k in ("A", "D") else v.astype(ml_dtypes.bfloat16).astype(np.float64) for k, v in f.items()}
    bf16, fp32_rounded, fp32 = run("bfloat16", f), run("float32", rounded), run("float32", f)
    for a, b, c in zip(bf16, fp32_rounded, fp32):
        assert _rel(a, b) <= 1e-6
        cos = float(np.sum(a * c) / (np.linalg.norm(a) * np.linalg.norm(c)))
        assert cos >= 0.9999, cos


@pytest.mark.parametrize("n", [1, 2, 4, 8, 16, 32, 64, 128])
def test_warp_butterfly_sums_every_value_once(n):
    """The CUDA backward's reduce-scatter of n values over a warp, on numpy lanes."""
    from lorac.compiler.units.scan_gpu import WARP, butterfly

    lanes = np.arange(WARP)
    vals = np.random.default_rng(n).standard_normal((n, WARP))  # value k as each lane holds it
    sums, base, spread = butterfly(list(vals), lambda o: (lanes & o) != 0, np.where, lambda x, o: x[lanes ^ o],
                                   lambda v: v)
    owner = np.ones(WARP, bool)
    for o in spread:
        owner &= (lanes & o) == 0
    got = {}
    for lane in lanes[owner]:
        for k, s in enumerate(sums):
            idx = int(np.broadcast_to(base, (WARP,))[lane]) + k
            assert idx not in got
            got[idx] = s[lane]
    assert sorted(got) == list(range(n))
    np.testing.assert_allclose([got[k] for k in range(n)], vals.sum(1), rtol=1e-12, atol=1e-12)


SMALL_MAMBA = dict(model_type="mamba", vocab_size=40, hidden_size=24, state_size=16, num_hidden_layers=2, expand=2,
                   conv_kernel=4, tie_word_embeddings=True)


def _small_mamba_train():
    from lorac.graphs import TrainSpec
    from lorac.graphs.mamba_spec import MAMBA_TARGETS
    return TrainSpec(batch=2, seq=21, rank=3, alpha=6, lora_targets=MAMBA_TARGETS, checkpointing=True,
                     extra={"scan_chunk": 8})


def _small_mamba_graph():
    """2 layers, 48 channels (a warp and a half), seq 21 in chunks of 8, checkpointed."""
    from lorac.graphs import ModelSpec, build_training_graph
    return build_training_graph(ModelSpec.from_hf_config(SMALL_MAMBA), _small_mamba_train())


def test_aarch64_build_maps_the_scan(tmp_path):
    """The CPU kernels cross-compiled for 64-bit Arm (NEON lanes)."""
    if shutil.which("aarch64-linux-gnu-gcc") is None:
        pytest.skip("needs aarch64-linux-gnu-gcc")
    from lorac.compiler import compile_graph
    art = compile_graph(_small_mamba_graph(), target="aarch64", out_dir=tmp_path / "arm")
    assert json.loads((art / "manifest.json").read_text())["units"] == ["SelectiveScan", "SelectiveScanGrad"]
    assert (art / "lib.so").read_bytes()[18] == 183  # ELF e_machine EM_AARCH64


def test_cuda_build_maps_the_scan(tmp_path):
    """A Mamba training graph for CUDA in both dtypes: the scan units become the CUDA kernels,
    which nvcc compiles into the artifact's fatbin."""
    if shutil.which("nvcc") is None:
        pytest.skip("needs nvcc")
    from lorac.compiler import compile_graph

    model = _small_mamba_graph()
    for dtype in ("float32", "bfloat16"):
        art = compile_graph(model, target={"kind": "cuda", "cuda_graph": True}, out_dir=tmp_path / dtype, dtype=dtype)
        m = json.loads((art / "manifest.json").read_text())
        swiglu = ["SwiGLUGrad"] if dtype == "bfloat16" else []  # the gate's backward: compiler/units/swiglu.py
        assert m["units"] == ["SelectiveScan", "SelectiveScanGrad", *swiglu] and m["unit_calls"] == []
        assert (art / m["extra"]["cuda_fatbin"]).stat().st_size > 0


# --- on a real GPU (marked gpu, skipped without one) ---------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("B,S,I,M,L", SHAPES + [(2, 70, 40, 32, 16)])
def test_cuda_scan_kernels_match_cpu(B, S, I, M, L, tmp_path):
    """The CUDA kernels (fp32) against the CPU ones: channels not a multiple of the warp, state
    8 and 4 (fewer sums than lanes: the butterfly ends in an all-reduce) and 32 (more)."""
    from lorac.compiler import compile_graph
    from lorac.runtime.engine.artifact import load_artifact
    d = ScanDims(B, S, I, M, L)
    f = {k: v.astype(np.float32) for k, v in _feeds(d).items()}
    want = _compiled(d, tmp_path)(f)
    got = load_artifact(compile_graph(_scan_graph(d), target="cuda", out_dir=tmp_path / "cuda"), "cuda")(f)
    for name in ("y", "hs", *GRADS):
        assert _rel(got[name], want[name]) <= 1e-5, name


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_mamba_matches_cpu(dtype, tmp_path):
    """A whole checkpointed Mamba training step (2 layers, seq 21 with chunk 8, 48 channels:
    one full warp and a partial one) on CUDA against the CPU artifact: fp32 to 1e-4, bf16
    (bf16 weights and scan inputs) loss within 1e-2 and every gradient's cosine >= 0.999."""
    from lorac.graphs import ModelSpec
    from test_compiler_targets import assert_cuda_matches_cpu
    from test_mamba_parity import feeds

    model = _small_mamba_graph()
    spec = ModelSpec.from_hf_config(SMALL_MAMBA)
    wanted = {i.name for i in model.graph.input}
    f = {k: v for k, v in feeds(SMALL_MAMBA, spec, _small_mamba_train()).items() if k in wanted}
    assert_cuda_matches_cpu(model, f, tmp_path, dtype)
