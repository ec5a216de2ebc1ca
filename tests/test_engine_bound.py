"""The engine with a training artifact whose inputs are bound (what a CUDA-graph build gets:
runtime/artifact.Step.bound_inputs), exercised on the CPU: eval loaded first, then the
training step; the frozen weights move into the training step's buffers once and every
artifact shares them; steps, updates, evals and logits equal the plain engine's."""
import numpy as np
import pytest

from tiny_model import make_model_dir

pytest.importorskip("tvm")


def _run(engine_mod, model_dir, cache, bind: bool):
    from lorac.graphs import ModelSpec, TrainSpec
    from lorac.runtime.train.optim import LoraPlusConfig, group_lrs
    from lorac.runtime.train.run import init_lora
    from lorac.runtime.model.weights import load_model

    cfg, weights = load_model(model_dir)
    spec = ModelSpec.from_hf_config(cfg)
    train = TrainSpec(batch=2, seq=16, lora_targets=tuple(spec.targets), rank=4, alpha=8.0)
    optim = LoraPlusConfig(lr=1e-2, loraplus_ratio=16.0, total_steps=4)
    eng = engine_mod.Engine(spec, train, weights, "cpu", cache_dir=cache, optim_cfg=optim, log=lambda m: None)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, spec.vocab, (2, 16)).astype(np.int64)
    batch = {"input_ids": ids, "labels": ids}
    zeros = {n: np.zeros(s, np.float32) for n, s in eng.shapes.items()}
    lora = init_lora(eng.shapes, np.random.default_rng(1))
    first_eval = eng.eval_loss(batch, lora)  # the eval artifact uploads the weights
    eng.set_state(lora, zeros, dict(zeros))
    losses = []
    for t in range(1, 4):
        out = eng.step({"input_ids": ids[:, ::-1].copy() if t == 2 else ids, "labels": ids}, eng.lora)
        losses.append(out.pop("loss"))
        eng.update(out, *group_lrs(t, optim), t)
    train_step = eng._artifact("train")
    assert train_step.bound_inputs is bind
    if bind:  # the weights now are the training step's own input buffers
        assert all(eng._weights[n] is train_step._buffers[n] for n in eng._weights)
    return first_eval, losses, eng.eval_loss(batch, eng.lora), eng.logits(ids[:1, :5], eng.lora)


def test_bound_training_artifact_matches_the_plain_engine(tmp_path, monkeypatch):
    from lorac.runtime.engine import tvm as engine

    model_dir = make_model_dir(tmp_path / "model")
    plain = _run(engine, model_dir, tmp_path / "cache", bind=False)
    load = engine.load_artifact

    def load_bound(art, device):
        step = load(art, device)
        step.bound_inputs = "train-" in str(art)  # as a CUDA-graph build's manifest says
        return step

    monkeypatch.setattr(engine, "load_artifact", load_bound)
    bound = _run(engine, model_dir, tmp_path / "cache", bind=True)
    assert abs(bound[0] - plain[0]) <= 1e-6 * abs(plain[0])
    np.testing.assert_allclose(bound[1], plain[1], rtol=1e-6)
    assert len(set(np.round(plain[1], 6))) == 3  # each step's loss differs: updates and batches took
    assert abs(bound[2] - plain[2]) <= 1e-6 * abs(plain[2])
    np.testing.assert_allclose(bound[3], plain[3], rtol=1e-5, atol=1e-6)


def test_graph_key_tells_scan_chunks_apart():
    """TrainSpec.extra is out of TrainSpec's repr; the cache key must still see it (two scan
    chunk lengths once shared one cached Mamba artifact)."""
    from lorac.graphs import ModelSpec, TrainSpec
    from lorac.runtime.engine.tvm import graph_key

    spec = ModelSpec.from_hf_config(dict(model_type="mamba", vocab_size=40, hidden_size=24, state_size=4,
                                         num_hidden_layers=2, expand=2, conv_kernel=4))
    t = lambda **extra: TrainSpec(batch=2, seq=16, lora_targets=("in_proj",), extra=extra)
    keys = {graph_key("train", spec, t(scan_chunk=L)) for L in (2, 4)} | {graph_key("train", spec, t())}
    assert len(keys) == 3
    assert graph_key("train", spec, t(scan_chunk=2)) == graph_key("train", spec, t(scan_chunk=2))
