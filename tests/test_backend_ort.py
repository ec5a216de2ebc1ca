"""The onnxruntime backend (runtime/engine/ort.py, `lorac train --backend ort`) on the CPU
provider: its loss sequence equals the TVM backend's to 1e-5 over 10 steps, checkpoints
resume across backends both ways, it runs without TVM and torch, and its engine agrees
with the TVM engine call by call (gradient accumulation's host path included)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tiny_model import make_workdir

pytest.importorskip("onnxruntime")
pytest.importorskip("tvm")
from lorac.runtime.cli import main  # noqa: E402


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return make_workdir(tmp_path_factory.mktemp("ort"))


def _args(d, out, steps, backend, *extra):
    return ["train", "--model", str(d / "model"), "--data", str(d / "corpus.txt"), "--out", str(out),
            "--steps", str(steps), "--batch", "4", "--seq", "32", "--lr", "2e-3", "--eval-every", "5",
            "--save-every", "5", "--eval-batches", "2", "--cache-dir", str(d / "cache"), "--backend", backend,
            "--progress", "lines", *extra]


def _curve(out) -> dict:
    """{(step, "loss" | "eval_loss"): value} from OUT/metrics.jsonl."""
    recs = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return {(r["step"], k): r[k] for r in recs for k in ("loss", "eval_loss") if k in r}


def _assert_same(a: dict, b: dict, tol: float = 1e-5):
    assert a.keys() == b.keys()
    worst = max(abs(a[k] - b[k]) for k in a)
    assert worst <= tol, f"largest difference {worst:.2e}"


@pytest.fixture(scope="module")
def runs(workdir):
    for backend in ("tvm", "ort"):
        assert main(_args(workdir, workdir / backend, 10, backend)) == 0
    return {b: _curve(workdir / b) for b in ("tvm", "ort")}


def test_ort_loss_sequence_equals_tvm(runs):
    assert len([k for k in runs["ort"] if k[1] == "loss"]) == 10
    _assert_same(runs["ort"], runs["tvm"])
    assert runs["ort"][(10, "eval_loss")] < runs["ort"][(0, "eval_loss")] - 0.1  # it trained


@pytest.mark.parametrize("first,then", [("tvm", "ort"), ("ort", "tvm")])
def test_checkpoints_resume_across_backends(workdir, runs, first, then):
    """Steps 6-10 resumed by the other backend from the step-5 checkpoint equal the uninterrupted run."""
    out = workdir / f"{first}-then-{then}"
    ckpt = workdir / first / "checkpoints" / "ckpt-000005"
    assert main(_args(workdir, out, 10, then, "--resume", str(ckpt))) == 0
    resumed = _curve(out)
    assert [k for k in resumed if k[1] == "loss"] == [(s, "loss") for s in range(6, 11)]
    _assert_same(resumed, {k: runs[first][k] for k in resumed})


def test_ort_backend_needs_neither_tvm_nor_torch(workdir):
    code = ("import sys\nfor m in ('tvm', 'tvm_ffi', 'torch'): sys.modules[m] = None\n"
            "from lorac.runtime.cli import main\nsys.exit(main(sys.argv[1:]))")
    r = subprocess.run([sys.executable, "-c", code, *_args(workdir, workdir / "no-tvm", 2, "ort")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "CPUExecutionProvider" in r.stderr and len(_curve(workdir / "no-tvm")) == 4


def test_ort_engine_agrees_with_the_tvm_engine(workdir):
    """eval, step, host-summed gradients (--grad-accum's path) into update, logits, state."""
    from lorac.graphs import ModelSpec, TrainSpec
    from lorac.runtime.engine import make_engine
    from lorac.runtime.train.optim import LoraPlusConfig
    from lorac.runtime.train.run import init_lora
    from lorac.runtime.model.weights import load_model

    cfg, weights = load_model(workdir / "model")
    spec = ModelSpec.from_hf_config(cfg)
    train = TrainSpec(batch=2, seq=16, lora_targets=("q_proj", "down_proj"), rank=4, alpha=8.0)
    ids = np.random.default_rng(0).integers(0, spec.vocab, (2, 16)).astype(np.int64)
    batch = {"input_ids": ids, "labels": ids}
    results = []
    for backend in ("tvm", "ort"):
        eng = make_engine(backend, spec, train, weights, "cpu", cache_dir=workdir / "cache", log=lambda m: None,
                          optim_cfg=LoraPlusConfig(lr=1e-2, total_steps=4))
        zeros = {n: np.zeros(s, np.float32) for n, s in eng.shapes.items()}
        lora = init_lora(eng.shapes, np.random.default_rng(1))
        lora = {n: (a + 0.01 if ".lora_B." in n else a) for n, a in lora.items()}  # every gradient non-zero
        r = [eng.eval_loss(batch, lora)]
        eng.set_state(lora, zeros, dict(zeros))
        for t in (1, 2):
            out = eng.step(batch, eng.lora)
            r.append(out.pop("loss"))
            grads = eng.host(out) if t == 2 else out  # step 2: numpy gradients, as --grad-accum passes them
            r.append(eng.update(grads, 1e-2, 0.16, t)[0])
        r.append(eng.logits(ids[:1, :7], eng.lora))
        results.append((r, eng.state_numpy()))
    (tvm_r, tvm_state), (ort_r, ort_state) = results
    np.testing.assert_allclose(ort_r[:-1], tvm_r[:-1], rtol=1e-5)
    np.testing.assert_allclose(ort_r[-1], tvm_r[-1], rtol=1e-4, atol=1e-5)
    for a, b in zip(ort_state, tvm_state):
        for n in a:
            np.testing.assert_allclose(a[n], b[n], rtol=1e-4, atol=1e-6, err_msg=n)


def test_providers_and_settings_are_checked_in_one_line():
    from lorac.runtime.engine.ort import resolve_providers
    from lorac.runtime.errors import LoracError
    from lorac.runtime.config import TrainConfig

    have = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    assert resolve_providers("cuda, CPU", have) == have
    with pytest.raises(LoracError, match="this onnxruntime has no DmlExecutionProvider; it has CUDA"):
        resolve_providers("DmlExecutionProvider", have)
    for kw, msg in ((dict(backend="ort", compile_only=True), "--backend ort compiles nothing ahead"),
                    (dict(ort_providers="cpu"), "--ort-providers is for --backend ort"),
                    (dict(backend="onnx"), "--backend must be tvm or ort")):
        with pytest.raises(LoracError, match=msg):
            TrainConfig(**kw).validate()
