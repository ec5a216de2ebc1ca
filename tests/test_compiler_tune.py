"""`--tune` (MetaSchedule on the CPU target): a tuned artifact gives the untuned one's
numbers, the tuning database lands in the cache directory and a second compile reuses it
without measuring, failing kernels keep their default, and targets without tuning say so
in one error."""
from __future__ import annotations

import json
import logging
import time

import pytest

from _compiler_graphs import assert_outputs_close, random_inputs, saved_training_graph
from lorac.compiler import compile_graph
from lorac.compiler.targets.cpu import tuning as cpu_tune
from lorac.compiler import tune
from lorac.compiler.cli import compile_command
from lorac.runtime.engine.artifact import load_artifact
from lorac.runtime.errors import LoracError

TRIALS = 16  # two kernels x 8 candidates: ~5 s of tuning on the 2-core box


@pytest.fixture(scope="module")
def graph(tmp_path_factory):
    return saved_training_graph(tmp_path_factory.mktemp("graph"))


@pytest.fixture(scope="module")
def untuned(graph, tmp_path_factory):
    return compile_graph(graph[0], target="cpu", out_dir=tmp_path_factory.mktemp("untuned") / "cpu")


def test_tune_matches_untuned_and_reuses_database(graph, untuned, tmp_path, monkeypatch, caplog):
    path, model = graph
    # keep every tuned kernel, however it timed, so the tuned schedules are really applied,
    # and tune reductions, whose schedules can change the order of summation
    monkeypatch.setattr(tune, "_MARGIN", float("-inf"))
    monkeypatch.setattr(tune, "_bytes", lambda task: int("softmax" in task.task_name or "sum" in task.task_name))
    caplog.set_level(logging.INFO, logger="lorac.compiler.tune")
    art = compile_graph(path, target="cpu", out_dir=tmp_path / "tuned", tune=TRIALS)

    db_path = tmp_path / ".lorac-tuning" / cpu_tune.DATABASE
    db = json.loads(db_path.read_text())
    (section,) = db.values()
    assert len(section) == TRIALS // 8 and all("softmax" in e["task"] or "sum" in e["task"] for e in section.values())
    assert all(e["record"] and e["trials"] == 8 and e["tuned_us"] > 0 for e in section.values()), section
    assert f"applied {len(section)} tuned kernel schedules" in caplog.text

    step, ref = load_artifact(art, "cpu"), load_artifact(untuned, "cpu")
    for seed in (0, 1):
        inputs = random_inputs(model, seed)
        assert_outputs_close(step(inputs), ref(inputs), 1e-5)

    # a second compile finds every kernel in the database: no tuning, database untouched
    def no_tuning(*_a, **_k):
        raise AssertionError("the second compile tuned again")

    monkeypatch.setattr(tune, "_tune_tasks", no_tuning)
    before = db_path.read_bytes()
    caplog.clear()
    t0 = time.perf_counter()
    again = compile_graph(path, target="cpu", out_dir=tmp_path / "tuned", tune=TRIALS, force=True)
    assert time.perf_counter() - t0 < 30  # a plain compile is ~4-7 s here
    assert db_path.read_bytes() == before
    assert "tuning 0 of" in caplog.text and f"applied {len(section)} tuned" in caplog.text
    assert_outputs_close(load_artifact(again, "cpu")(random_inputs(model, 0)), ref(random_inputs(model, 0)), 1e-5)


def test_tune_keeps_default_where_it_is_not_faster(graph, untuned, tmp_path, monkeypatch, caplog):
    """With a margin no candidate can meet, every kernel keeps its default schedule: the
    database records the timings but no schedule, and the artifact is the untuned one."""
    path, model = graph
    monkeypatch.setattr(tune, "_MARGIN", 1.0)
    caplog.set_level(logging.INFO, logger="lorac.compiler.tune")
    art = compile_graph(path, target="cpu", out_dir=tmp_path / "tuned", tune=8)
    (section,) = json.loads((tmp_path / ".lorac-tuning" / cpu_tune.DATABASE).read_text()).values()
    assert len(section) == 1
    (entry,) = section.values()
    assert entry["record"] is None and entry["default_us"] > 0 and entry["tuned_us"] > 0
    assert "applied 0 tuned kernel schedules" in caplog.text
    inputs = random_inputs(model, 0)
    assert_outputs_close(load_artifact(art, "cpu")(inputs), load_artifact(untuned, "cpu")(inputs), 1e-5)


def test_tune_skips_a_failing_kernel_and_fails_when_all_do(graph, untuned, tmp_path, monkeypatch):
    """A kernel MetaSchedule fails on keeps its default schedule; when every kernel to tune
    fails, the compile stops with one LoracError and the database is left as it was."""
    path, model = graph
    real = tune._context
    calls = []

    def first_fails(task, target, rules):
        calls.append(task.task_name)
        if len(calls) == 1:
            raise RuntimeError("simulated MetaSchedule failure")
        return real(task, target, rules)

    monkeypatch.setattr(tune, "_context", first_fails)
    art = compile_graph(path, target="cpu", out_dir=tmp_path / "tuned", tune=TRIALS)
    db_path = tmp_path / ".lorac-tuning" / cpu_tune.DATABASE
    (section,) = json.loads(db_path.read_text()).values()
    errors = [e for e in section.values() if "error" in e]
    assert len(section) == 2 and len(errors) == 1
    assert errors[0]["error"] == "simulated MetaSchedule failure" and errors[0]["record"] is None
    inputs = random_inputs(model, 0)
    assert_outputs_close(load_artifact(art, "cpu")(inputs), load_artifact(untuned, "cpu")(inputs), 1e-5)

    def always_fails(task, target, rules):
        raise RuntimeError("simulated MetaSchedule failure")

    monkeypatch.setattr(tune, "_context", always_fails)
    before = db_path.read_bytes()
    with pytest.raises(LoracError, match="^MetaSchedule could not tune any kernel: simulated MetaSchedule failure$"):
        compile_graph(path, target="cpu", out_dir=tmp_path / "tuned", tune=3 * 8, force=True)
    assert db_path.read_bytes() == before


def test_tune_unavailable_target_and_bad_trials(graph, tmp_path, capsys):
    path, _ = graph
    with pytest.raises(LoracError, match="--tune is not available for target opencl"):
        compile_graph(path, target="opencl", out_dir=tmp_path / "cl", tune=4)
    assert compile_command([str(path), "--target", "cpu", "--out", str(tmp_path / "neg"), "--tune", "-1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["lorac compile: error: --tune takes a number of trials >= 0, got -1"]


def test_train_setting_reaches_the_training_steps_compile(tmp_path, monkeypatch):
    """`lorac train --tune N` (TrainConfig.tune -> make_engine -> Engine) tunes the training
    step's build and no other graph's."""
    from tiny_model import make_model_dir

    from lorac.graphs import ModelSpec, TrainSpec
    from lorac.runtime.engine import make_engine
    from lorac.runtime.engine import tvm as engine_mod
    from lorac.runtime.train.optim import LoraPlusConfig
    from lorac.runtime.model.weights import load_model

    seen = {}
    monkeypatch.setattr(engine_mod, "compiled", lambda build, key, name, *a, **k: seen.setdefault(name, k["tune"]))
    cfg, weights = load_model(make_model_dir(tmp_path / "model"))
    spec = ModelSpec.from_hf_config(cfg)
    train = TrainSpec(batch=1, seq=8, lora_targets=tuple(spec.targets), rank=4, alpha=8.0)
    eng = make_engine("tvm", spec, train, weights, "cpu", cache_dir=tmp_path,
                      optim_cfg=LoraPlusConfig(), log=lambda m: None, tune=16)
    for kind in ("train", "adamw", "eval"):
        eng.compile(kind)
    assert seen == {"train": 16, "adamw": 0, "eval": 0}
