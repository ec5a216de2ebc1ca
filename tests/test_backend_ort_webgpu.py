"""`lorac train --target webgpu` (onnxruntime's WebGPU plugin, runtime/engine/ort.py) with the
CPU standing in for the GPU: the CPU execution provider's device entry takes the WebGPU one's
place and a numpy copy takes the plugin's data transfer (onnxruntime.copy_tensors), so every
line of the device-resident path runs: the session on a device entry, the weights, LoRA and
AdamW state uploaded once, per step only the batch in and the loss, grad norm and skipped flag
out, checkpoints, eval and generate, the summary's adapter. The GPU test runs the real plugin
where a WebGPU adapter exists."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tiny_model import make_workdir

ort = pytest.importorskip("onnxruntime")
from lorac.runtime.cli import main  # noqa: E402
from lorac.runtime.engine import ort_webgpu  # noqa: E402
from webgpu_stand_in import ADAPTER, install  # noqa: E402


@pytest.fixture
def stand_in(monkeypatch):
    return install(monkeypatch.setattr)


def _tiny():
    from lorac.graphs import ModelSpec, TrainSpec, build_training_graph
    spec = ModelSpec.from_hf_config(dict(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=8, tie_word_embeddings=True))
    train = TrainSpec(batch=2, seq=16, rank=4, alpha=8.0, lora_targets=("q_proj", "v_proj", "down_proj"))
    rng = np.random.default_rng(0)
    weights = {}
    for i in build_training_graph(spec, train).graph.input:
        shape = [d.dim_value for d in i.type.tensor_type.shape.dim]
        if i.name not in ("input_ids", "labels") and ".lora_" not in i.name:
            weights[i.name] = (np.ones(shape) if "norm" in i.name else 0.2 * rng.standard_normal(shape)).astype(np.float32)
    return spec, train, weights


def _drive(eng, spec) -> tuple[list, tuple]:
    """eval (per-tensor numpy LoRA), 3 steps (the loss read after the update, as `lorac
    train`; the second through host gradients, as --grad-accum), logits, state."""
    from lorac.runtime.train.optim import LoraPlusConfig, group_lrs
    from lorac.runtime.train.run import init_lora
    lora = init_lora(eng.shapes, np.random.default_rng(1))
    lora = {n: (a + 0.05 if ".lora_B." in n else a) for n, a in lora.items()}
    zeros = {n: np.zeros(s, np.float32) for n, s in eng.shapes.items()}
    ids = np.random.default_rng(2).integers(0, spec.vocab, (2, 16)).astype(np.int64)
    batch = {"input_ids": ids, "labels": ids}
    r = [eng.eval_loss(batch, lora)]
    eng.set_state(lora, zeros, dict(zeros))
    eng.compile("adamw")
    cfg = LoraPlusConfig(lr=1e-2, total_steps=3)
    for t in (1, 2, 3):
        out = eng.step(batch, eng.lora, read_loss=False)
        loss = out.pop("loss")
        grads = eng.host(out) if t == 2 else out
        r.append(eng.update(grads, *group_lrs(t, cfg), t)[0])
        r.append(float(loss.numpy()))
    r.append(eng.eval_loss(batch, eng.lora))
    r.append(eng.logits(ids[:1, :5], eng.lora))
    return r, eng.state_numpy()


def test_device_resident_path_with_the_cpu_standing_in(stand_in):
    from lorac.runtime.engine.ort import OrtEngine
    from lorac.runtime.train.optim import LoraPlusConfig
    spec, train, weights = _tiny()
    cfg = LoraPlusConfig(lr=1e-2, total_steps=3)
    host = OrtEngine(spec, train, weights, "cpu", optim_cfg=cfg, log=lambda m: None)
    logs = []
    dev = OrtEngine(spec, train, weights, "webgpu", optim_cfg=cfg, log=logs.append)
    assert isinstance(dev._values, stand_in) and dev.providers == ["WebGpuExecutionProvider",
                                                                        "CPUExecutionProvider"]
    assert dev.describe()["adapter"] == ADAPTER and "stand-in" in logs[0] and "buffers on the device" in logs[0]
    (hr, hs), (dr, ds) = _drive(host, spec), _drive(dev, spec)
    np.testing.assert_allclose(dr[:-1], hr[:-1], rtol=1e-6)
    np.testing.assert_allclose(dr[-1], hr[-1], rtol=1e-6, atol=1e-7)
    for a, b in zip(ds, hs):
        for n in a:
            np.testing.assert_allclose(a[n], b[n], rtol=1e-6, atol=1e-8, err_msg=n)
    # residency: the weights once, the state once (p, m, v), then per step three scalars back
    # (the loss; grad norm and skipped flag in one copy) and, for the host-summed step only,
    # the gradients read out; the eval loss, the logits and the state at the end
    log = stand_in.log
    assert log[:2] == [("put", len(weights)), ("read", 1)]  # the first eval: weights up, loss back
    assert log[2:5] == [("put", len(dev._buckets))] * 3
    steps = log[5:-3]
    per_step = [("read", 2), ("read", 1)]
    assert steps == per_step + [("read", 1)] * len(dev._buckets) + per_step + per_step, steps
    assert log[-3:] == [("read", 1), ("read", 1), ("read", 3 * len(dev._buckets))]
    assert dev._values.copies == len(log)  # every put and read is one copy call
    # nothing but the batch and the optimizer's scalars is bound from numpy
    for kind, s in dev._sessions.items():
        numpy_bound = {n for n, (_, v) in s._bound.items() if isinstance(v, np.ndarray)}
        assert numpy_bound <= {"input_ids", "labels", "lr_a", "lr_b", "step"}, (kind, numpy_bound)
    assert sum(dev.placement["train"]["CPUExecutionProvider"].values()) > 100  # recorded per session


def _args(d: Path, out: Path, steps: int, *extra) -> list[str]:
    return ["train", "--model", str(d / "model"), "--data", str(d / "corpus.txt"), "--out", str(out), "--steps",
            str(steps), "--batch", "2", "--seq", "32", "--lr", "2e-3", "--eval-every", "2", "--save-every", "2",
            "--eval-batches", "1", "--sample-tokens", "4", "--progress", "lines", "--cache-dir", str(d / "cache"),
            *extra]


def _curve(out: Path) -> dict:
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {(r["step"], k): r[k] for r in recs for k in ("loss", "eval_loss") if k in r}


def test_lorac_train_eval_generate_target_webgpu_with_the_cpu_standing_in(tmp_path, stand_in, capsys):
    d = make_workdir(tmp_path)
    assert main(_args(d, tmp_path / "cpu", 4, "--backend", "ort")) == 0
    assert main(_args(d, tmp_path / "webgpu", 4, "--target", "webgpu")) == 0
    cpu, web = _curve(tmp_path / "cpu"), _curve(tmp_path / "webgpu")
    assert cpu.keys() == web.keys() and max(abs(cpu[k] - web[k]) for k in cpu) <= 1e-6
    summary = json.loads((tmp_path / "webgpu" / "summary.json").read_text())
    assert summary["device"]["adapter"] == ADAPTER and summary["device"]["target"] == "webgpu"
    assert summary["device"]["providers"][0] == "WebGpuExecutionProvider" and summary["adapter"]
    from lorac.runtime.train.checkpoint import read_state
    state = read_state(tmp_path / "webgpu" / "checkpoints" / "ckpt-000004")
    assert (state["train_config"]["backend"], state["train_config"]["target"]) == ("ort", "webgpu")
    assert state["device"]["adapter"] == ADAPTER  # the checkpoint says which adapter trained it
    # its checkpoint resumes on the CPU provider and gives the uninterrupted run's steps
    ckpt = tmp_path / "webgpu" / "checkpoints" / "ckpt-000002"
    assert main(_args(d, tmp_path / "resumed", 4, "--backend", "ort", "--resume", str(ckpt))) == 0
    resumed = _curve(tmp_path / "resumed")
    assert [k for k in resumed if k[1] == "loss"] == [(3, "loss"), (4, "loss")]
    assert max(abs(resumed[k] - web[k]) for k in resumed) <= 1e-6
    capsys.readouterr()
    common = ["--checkpoint", str(tmp_path / "webgpu" / "checkpoints")]
    assert main(["eval", *common, "--data", str(d / "corpus.txt"), "--target", "webgpu"]) == 0
    web_eval = json.loads(capsys.readouterr().out)
    assert main(["eval", *common, "--data", str(d / "corpus.txt"), "--backend", "ort"]) == 0
    assert json.loads(capsys.readouterr().out) == web_eval
    assert main(["generate", *common, "--prompt", "the red", "--max-new-tokens", "6", "--target", "webgpu"]) == 0
    web_text = capsys.readouterr().out
    assert main(["generate", *common, "--prompt", "the red", "--max-new-tokens", "6", "--backend", "ort"]) == 0
    assert capsys.readouterr().out == web_text


@pytest.mark.gpu
def test_webgpu_adapter_trains_as_the_cpu_provider(tmp_path):
    """The real plugin on a GPU: 4 steps equal the CPU provider's to 1e-4 relative."""
    pytest.importorskip("onnxruntime_ep_webgpu")
    from lorac.runtime.errors import LoracError
    try:
        ort_webgpu.check()
    except LoracError as e:
        pytest.skip(str(e))
    d = make_workdir(tmp_path)
    assert main(_args(d, tmp_path / "cpu", 4, "--backend", "ort")) == 0
    assert main(_args(d, tmp_path / "webgpu", 4, "--target", "webgpu")) == 0
    cpu, web = _curve(tmp_path / "cpu"), _curve(tmp_path / "webgpu")
    assert cpu.keys() == web.keys()
    assert max(abs(cpu[k] - web[k]) / abs(cpu[k]) for k in cpu) <= 1e-4
    summary = json.loads((tmp_path / "webgpu" / "summary.json").read_text())
    assert summary["device"]["adapter"]["execution_provider"] == "WebGpuExecutionProvider"
