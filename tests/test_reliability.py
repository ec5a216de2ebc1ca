"""The reliability suite: each failure class of issue 15 replayed against `lorac` on a tiny model.

A planted cache library never runs, exports never touch the base model, SIGTERM/SIGHUP leave a
resumable checkpoint and a nonzero status, a resume after kill -9 logs each step once, two runs
into one directory cannot corrupt each other, a resume is the run it continues (same model
weights, data, settings, schedule), and bad input gets one line and a nonzero status. Commands
that need signals, kills or a second process run as subprocesses; the others run in-process
with LORAC_TRACEBACK=1, so an unexpected exception fails the test instead of being reported.
"""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from test_artifact_trust import evil_library
from test_train_e2e import LORAC, _records, _run, _train_args
from tiny_model import make_corpus, make_model_dir, make_workdir

pytest.importorskip("tvm")
STEPS = 12


@pytest.fixture(scope="session")  # shared with tests/test_reliability_*.py, which import it
def work(tmp_path_factory):
    d = make_workdir(tmp_path_factory.mktemp("reliability"))
    r = _run(_train_args(d, d / "ref", STEPS, "--save-every", "4"))
    assert r.returncode == 0, r.stderr[-2000:]
    return d


def lorac(argv, capsys, monkeypatch) -> tuple[int, str]:
    """`lorac argv` in this process: (exit status, stderr); a traceback fails the test."""
    from lorac.runtime.cli import main
    monkeypatch.setenv("LORAC_TRACEBACK", "1")
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    return rc, capsys.readouterr().err


def one_line_error(rc, err, match):
    last = err.strip().splitlines()[-1] if err.strip() else ""
    assert rc == 2 and last.startswith("lorac: error:") and match in last, (rc, err[-1500:])
    assert "Traceback" not in err


def tree_digest(folder: Path) -> dict:
    from lorac.core.integrity import sha256_file
    return {p.relative_to(folder).as_posix(): sha256_file(p) for p in sorted(folder.rglob("*")) if p.is_file()}


def _wait_for_steps(out: Path, n: int, proc, timeout=300) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if (out / "metrics.jsonl").exists() and sum('"loss"' in ln for ln in (out / "metrics.jsonl").read_text().splitlines()) >= n:
            return
        time.sleep(0.02)
    raise AssertionError(f"the run did not reach step {n}")


SLOW = ("--save-every", "100", "--eval-every", "1", "--eval-batches", "8")  # slows steps, not their losses


# -- security -----------------------------------------------------------------------------
@pytest.mark.slow
def test_planted_cache_library_never_runs_and_the_entry_is_rebuilt(work, tmp_path):
    cache = tmp_path / "cache"
    import shutil
    shutil.copytree(work / "cache", cache)
    entry = next(p for p in cache.iterdir() if p.name.startswith("train-cpu-") and p.is_dir())
    marker = tmp_path / "ran"
    shutil.copyfile(evil_library(tmp_path, marker), entry / "lib.so")
    r = _run(_train_args(work, tmp_path / "out", 2, "--cache-dir", str(cache)))
    assert r.returncode == 0, r.stderr[-2000:]
    assert not marker.exists()
    assert f"cache entry {entry.name} is unusable" in r.stderr and "rebuilding it" in r.stderr


# -- data loss ------------------------------------------------------------------------------
def test_exports_never_write_over_what_they_read(work, tmp_path, capsys, monkeypatch):
    ck = work / "ref" / "checkpoints"
    before = tree_digest(work / "model")
    for fmt, out, match in [
        ("merged", work / "model", f"--out {work / 'model'} is {work / 'model'}, which this export reads"),
        ("merged", work, "holds"),                       # a folder that holds the base model
        ("peft", ck, "which this export reads"),         # the checkpoint root
        ("gguf", ck / "latest", "lies inside"),          # the checkpoint pointer
        ("gguf", work / "model" / "model.safetensors", "lies inside"),
    ]:
        one_line_error(*lorac(["export", "--checkpoint", ck, "--format", fmt, "--out", out], capsys, monkeypatch), match)
    assert tree_digest(work / "model") == before
    (tmp_path / "a_file").write_text("mine")
    one_line_error(*lorac(["export", "--checkpoint", ck, "--out", tmp_path / "a_file"], capsys, monkeypatch), "is a file")
    one_line_error(*lorac(["export", "--checkpoint", ck, "--format", "gguf", "--out", tmp_path], capsys, monkeypatch),
                   "is a directory")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    one_line_error(*lorac(["export", "--checkpoint", ck, "--out", tmp_path / "notes"], capsys, monkeypatch), "holds todo.txt")
    assert (tmp_path / "notes" / "todo.txt").read_text() == "mine" and (tmp_path / "a_file").read_text() == "mine"
    for _ in range(2):  # a previous export of the same kind is replaced whole
        rc, err = lorac(["export", "--checkpoint", ck, "--format", "merged", "--out", tmp_path / "m"], capsys, monkeypatch)
        assert rc == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "m", "notes"]  # no staging left


def test_a_checkpoint_with_nan_lora_values_is_not_exported(work, tmp_path, capsys, monkeypatch):
    from lorac.runtime.train.checkpoint import load_checkpoint, save_checkpoint
    ck = load_checkpoint(work / "ref" / "checkpoints")
    name = sorted(ck.lora)[0]
    ck.lora[name][0, 0] = np.nan
    state = {k: v for k, v in ck.state.items() if k not in ("format", "lorac_version", "step", "files", "state_sha256")}
    bad = save_checkpoint(tmp_path / "ckpts", ck.step, ck.lora, ck.m, ck.v, state)
    for fmt in ("peft", "merged", "gguf"):
        out = tmp_path / f"out-{fmt}"
        rc, err = lorac(["export", "--checkpoint", bad, "--format", fmt, "--out", out], capsys, monkeypatch)
        one_line_error(rc, err, "holds NaN or infinite values; nothing exported")
        assert not out.exists()


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_and_sighup_save_a_checkpoint_and_exit_nonzero(work, tmp_path, sig):
    out = tmp_path / "run"
    p = subprocess.Popen(LORAC + _train_args(work, out, STEPS, *SLOW), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    _wait_for_steps(out, 3, p)
    p.send_signal(sig)
    stdout, err = p.communicate(timeout=120)
    assert p.returncode == 128 + sig, err[-2000:]
    assert json.loads(stdout)["stopped_by"] == signal.Signals(sig).name and "Traceback" not in err
    stopped = max(r["step"] for r in _records(out) if "loss" in r)
    from lorac.runtime.train.checkpoint import load_checkpoint
    assert load_checkpoint(out / "checkpoints").step == stopped < STEPS
    if sig == signal.SIGTERM:  # the checkpoint resumes into exactly the uninterrupted run
        r = _run(_train_args(work, out, STEPS, *SLOW, "--resume", str(out / "checkpoints")))
        assert r.returncode == 0, r.stderr[-2000:]
        got = {r["step"]: r["loss"] for r in _records(out) if "loss" in r}
        ref = {r["step"]: r["loss"] for r in _records(work / "ref") if "loss" in r}
        assert sorted(got) == list(range(1, STEPS + 1))
        assert all(abs(got[s] - ref[s]) <= 1e-6 * abs(ref[s]) for s in got)


@pytest.mark.slow
def test_resume_after_kill_9_logs_each_step_once(work, tmp_path):
    out = tmp_path / "run"
    args = _train_args(work, out, STEPS, "--save-every", "3", "--eval-every", "1", "--eval-batches", "8")
    p = subprocess.Popen(LORAC + args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait_for_steps(out, 8, p)
    os.kill(p.pid, signal.SIGKILL)
    p.wait(timeout=60)
    logged = max(r["step"] for r in _records(out) if "loss" in r)
    from lorac.runtime.train.checkpoint import load_checkpoint
    assert load_checkpoint(out / "checkpoints").step < logged  # steps after the checkpoint were logged
    r = _run(args + ["--resume", str(out / "checkpoints")])
    assert r.returncode == 0, r.stderr[-2000:]
    recs = _records(out)
    assert [r["step"] for r in recs if "loss" in r] == list(range(1, STEPS + 1))
    evals = [r["step"] for r in recs if "eval_loss" in r]
    assert evals == sorted(set(evals))


@pytest.mark.slow
def test_two_runs_into_one_directory_do_not_collide(work, tmp_path):
    out = tmp_path / "run"
    first = subprocess.Popen(LORAC + _train_args(work, out, 6, *SLOW), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    _wait_for_steps(out, 1, first)
    first.send_signal(signal.SIGSTOP)  # held mid-run (with its lock) while the second one tries
    try:
        t0 = time.time()
        second = _run(_train_args(work, out, 6))
        assert second.returncode == 2 and time.time() - t0 < 60
        last = second.stderr.strip().splitlines()[-1]
        assert last.startswith(f"lorac: error: {out} is in use by another lorac run (pid {first.pid})"), last
    finally:
        first.send_signal(signal.SIGCONT)
    _, err = first.communicate(timeout=300)
    assert first.returncode == 0, err[-2000:]
    assert [r["step"] for r in _records(out) if "loss" in r] == list(range(1, 7))
    r = _run(_train_args(work, out, 7, "--resume", str(out / "checkpoints")))  # free again once it ended
    assert r.returncode == 0, r.stderr[-2000:]


# -- silently wrong -------------------------------------------------------------------------
def test_resume_refuses_another_model_data_or_settings(work, tmp_path, capsys, monkeypatch):
    twin = make_model_dir(tmp_path / "twin", seed=1)  # the same config.json, other weights
    assert (twin / "config.json").read_text() == (work / "model" / "config.json").read_text()
    other_data = make_corpus(tmp_path / "other.txt", 120)
    ck = str(work / "ref" / "checkpoints")
    for extra, match in [
        (["--model", twin], "was made for another model"),
        (["--lr", "1e-3"], "it was trained with --lr 0.002, this run asks for 0.001"),
        (["--warmup", "2"], "it was trained with --warmup 4"),
        (["--data", other_data], "the training data differ from the checkpoint's"),
    ]:
        rc, err = lorac(_train_args(work, tmp_path / "o", STEPS, "--resume", ck, *extra), capsys, monkeypatch)
        one_line_error(rc, err, match)


def test_a_longer_resumed_run_keeps_the_learning_rate_schedule(work, tmp_path, capsys, monkeypatch):
    import shutil
    out = tmp_path / "run"
    shutil.copytree(work / "ref", out)
    rc, err = lorac(_train_args(work, out, STEPS + 4, "--resume", out / "checkpoints"), capsys, monkeypatch)
    assert rc == 0, err[-2000:]
    assert f"the learning-rate schedule stays the checkpoint's (cosine to step {STEPS})" in err
    lrs = {r["step"]: r["lr"] for r in _records(out) if "loss" in r}
    assert sorted(lrs) == list(range(1, STEPS + 5))
    assert all(lrs[s + 1] <= lrs[s] + 1e-12 for s in range(5, STEPS + 4))  # past warmup: never up again
    assert all(lrs[s] == pytest.approx(2e-3 / 10) for s in range(STEPS, STEPS + 5))  # the schedule's floor


# -- bounded resources, one line ------------------------------------------------------------
def _config_dir(work, tmp_path, edit) -> Path:
    d = tmp_path / "model"
    import shutil
    shutil.copytree(work / "model", d)
    cfg = json.loads((d / "config.json").read_text())
    edit(cfg)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


BAD_CONFIGS = {
    "no hidden_size": (lambda c: c.pop("hidden_size"), "config.json has no hidden_size"),
    "heads 0": (lambda c: c.update(num_attention_heads=0), "num_attention_heads=0 must be a positive integer"),
    "rope_parameters a string": (lambda c: c.update(rope_parameters="yarn"), "rope_parameters must be an object"),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_bad_model_config_is_one_line(work, tmp_path, capsys, monkeypatch, case):
    edit, match = BAD_CONFIGS[case]
    model = _config_dir(work, tmp_path, edit)
    one_line_error(*lorac(_train_args(work, tmp_path / "o", 2, "--model", model), capsys, monkeypatch), match)


@pytest.mark.parametrize("toml,match", [
    ("targets = 5", "targets = 5 must be a string or a list of strings"),
    ("trained_layers = 1", "trained_layers = 1 must be a string"),
    ('resume = ["a"]', "resume = ['a'] must be a string"),
    ("steps = 2.5", "steps = 2.5 must be an integer"),
])
def test_bad_toml_values_are_one_line(work, tmp_path, capsys, monkeypatch, toml, match):
    (tmp_path / "run.toml").write_text(toml + "\n")
    one_line_error(*lorac(["train", "--config", tmp_path / "run.toml"], capsys, monkeypatch), match)


def test_sizes_beyond_the_model_are_refused_before_compiling(work, tmp_path, capsys, monkeypatch):
    cached = sorted(os.listdir(work / "cache"))
    one_line_error(*lorac(_train_args(work, tmp_path / "o", 2, "--seq", "100000"), capsys, monkeypatch),
                   "--seq 100000 exceeds the model's context length 512")
    one_line_error(*lorac(_train_args(work, tmp_path / "o", 2, "--rank", "100000"), capsys, monkeypatch),
                   "--rank 100000 exceeds the width of every adapted projection (at most 48)")
    one_line_error(*lorac(["generate", "--checkpoint", work / "ref" / "checkpoints", "--prompt", "x", "--window",
                           "100000", "--cache-dir", work / "cache"], capsys, monkeypatch),
                   "--window 100000 exceeds the model's context length 512")
    one_line_error(*lorac(_train_args(work, tmp_path / "o", 2, "--seq", "512", "--batch", "100000"), capsys, monkeypatch),
                   "GiB available")
    assert sorted(os.listdir(work / "cache")) == cached  # nothing was compiled


def test_answerless_data_and_blank_eval_lines(work, tmp_path, capsys, monkeypatch):
    data = tmp_path / "qa.jsonl"
    prompt = "a" * 40  # 40 tokens of the char tokenizer, --seq 20: EOS, the only counted token, opens a row
    data.write_text(json.dumps({"prompt": prompt, "completion": ""}) + "\n")
    one_line_error(*lorac(_train_args(work, tmp_path / "o", 2, "--data", data, "--seq", "20", "--eval-fraction", "0",
                                      "--eval-batches", "0"), capsys, monkeypatch), "all 3 training rows were dropped")
    ev = tmp_path / "ev.jsonl"
    ev.write_text("\n" + json.dumps({"prompt": "the red cat ", "completion": "sat on the mat."}) + "\n")
    rc, err = lorac(_train_args(work, tmp_path / "o2", 1, "--eval-data", ev, "--sample-tokens", "4"), capsys, monkeypatch)
    assert rc == 0, err[-2000:]
    assert "> the red cat" in err  # the sample prompt came from the first record after the blank line


def test_cuda_memory_is_checked_against_the_gpu_when_one_is_visible(monkeypatch):
    """On CUDA the lower bound (bf16 weights, no [S, S] attention: cuDNN) is compared with
    the GPU's free memory; a machine without a GPU (compile-only) has nothing to compare."""
    from lorac.graphs import ModelSpec, TrainSpec
    from lorac.runtime import devices
    from lorac.runtime import limits
    from lorac.runtime.errors import LoracError

    spec = ModelSpec(arch="qwen3", vocab=1000, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=96)
    train = TrainSpec(batch=4, seq=2048, lora_targets=("q_proj",), rank=4)
    gpu = devices.for_target("cuda")
    cpu = limits.step_bytes_lower_bound(spec, train, 10 ** 6, devices.for_target("cpu"))
    cuda = limits.step_bytes_lower_bound(spec, train, 10 ** 6, gpu)
    assert cpu - cuda == 4 * (4 * 4 * 2048 * 2048 + 10 ** 6 // 2)  # the probabilities and half the weights
    monkeypatch.setattr(gpu, "memory_free", lambda: cuda - 1)
    with pytest.raises(LoracError, match="the GPU has"):
        limits.check_memory(spec, train, 10 ** 6, gpu)
    monkeypatch.setattr(gpu, "memory_free", lambda: None)
    limits.check_memory(spec, train, 10 ** 6, gpu)
    # frozen weights that alone exceed the GPU: a smaller batch cannot help, a quantized base can
    monkeypatch.setattr(gpu, "memory_free", lambda: 2 * 10 ** 6 - 1)
    with pytest.raises(LoracError, match=r"the frozen weights alone take .* --quantize nf4 \(or int8\)"):
        limits.check_memory(spec, train, 10 ** 6, gpu)  # 10^6 bf16 elements
    with pytest.raises(LoracError, match="--quantize-embeddings nf4"):  # the layers are quantized already
        limits.check_memory(spec, train, 10 ** 6, gpu, packed_bytes=10 ** 5)
    with pytest.raises(LoracError, match="a smaller model"):  # nothing dense left to quantize
        limits.check_memory(spec, train, 0, gpu, packed_bytes=2 * 10 ** 6)
