"""End to end on a tiny random HF model directory made here: training learns, resume is exact,
Ctrl-C saves, the exported adapter loads in PEFT and transformers with lorac's logits."""
import json
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from tiny_model import compiled_logits, make_model_dir, make_workdir

pytest.importorskip("tvm")
from conftest import LORAC, run_lorac  # noqa: E402 - the `lorac` command (tests/conftest.py)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return make_workdir(tmp_path_factory.mktemp("e2e"))


def _train_args(d, out, steps, *extra):
    return ["train", "--model", str(d / "model"), "--data", str(d / "corpus.txt"), "--out", str(out),
            "--steps", str(steps), "--batch", "4", "--seq", "32", "--lr", "2e-3", "--eval-every", "10",
            "--save-every", "5", "--cache-dir", str(d / "cache"), "--targets", "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
            *extra]


def _run(args, **kw):
    return run_lorac(args, **kw)


def _records(out):
    return [json.loads(l) for l in (Path(out) / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def trained(workdir):
    out = workdir / "run"
    r = _run(_train_args(workdir, out, 30))
    assert r.returncode == 0, r.stderr[-2000:]
    return out


def test_training_and_eval_loss_drop(trained):
    recs = _records(trained)
    assert "eval_loss" in recs[0] and recs[0]["step"] == 0  # the first eval runs before step 1
    steps = [r for r in recs if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 31))
    assert all({"step", "loss", "lr", "tokens_per_s"} <= set(r) for r in steps)
    losses = [r["loss"] for r in steps]
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.1
    evals = [r["eval_loss"] for r in recs if "eval_loss" in r]
    assert evals[-1] < evals[0] - 0.1
    summary = json.loads((trained / "summary.json").read_text())
    assert summary["eval_loss_after"] < summary["eval_loss_before"]
    assert (trained / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (trained / "adapter" / "adapter_model.safetensors").is_file()


def test_peft_and_merged_exports_match_lorac_logits(workdir, trained):
    import torch
    from peft import PeftModel
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM
    lora = load_file(str(trained / "adapter" / "adapter_model.safetensors"))
    assert any(np.abs(v).max() > 0 for k, v in lora.items() if "lora_B" in k)
    ids = np.random.default_rng(0).integers(0, 60, (1, 24)).astype(np.int64)
    ours = compiled_logits(workdir / "model", workdir / "cache", lora, ids)
    base = AutoModelForCausalLM.from_pretrained(workdir / "model").float().eval()
    peft = PeftModel.from_pretrained(base, trained / "adapter").eval()
    with torch.no_grad():
        theirs = peft(input_ids=torch.from_numpy(ids)).logits.numpy()
    assert np.abs(ours - theirs).max() <= 1e-4 * max(1.0, np.abs(theirs).max())
    merged = workdir / "merged"
    r = _run(["export", "--checkpoint", str(trained / "checkpoints"), "--format", "merged", "--out", str(merged)])
    assert r.returncode == 0, r.stderr[-2000:]
    m = AutoModelForCausalLM.from_pretrained(merged).float().eval()
    with torch.no_grad():
        merged_logits = m(input_ids=torch.from_numpy(ids)).logits.numpy()
    assert np.abs(ours - merged_logits).max() <= 1e-4 * max(1.0, np.abs(merged_logits).max())
    r = _run(["export", "--checkpoint", str(trained / "checkpoints"), "--format", "gguf", "--out", str(workdir / "a.gguf")])
    assert r.returncode == 0, r.stderr[-2000:]
    assert (workdir / "a.gguf").stat().st_size > 0


def test_written_files_respect_the_umask(workdir, trained):
    """The safetensors library creates files 0600; lorac gives everything it writes umask's modes."""
    from lorac.runtime.files import current_umask
    r = _run(["export", "--checkpoint", str(trained / "checkpoints"), "--out", str(workdir / "peft")])
    assert r.returncode == 0, r.stderr[-2000:]
    files = [*(trained / "adapter").iterdir(), *(workdir / "peft").iterdir(),
             *next((trained / "checkpoints").glob("ckpt-*")).iterdir()]
    assert any(f.suffix == ".safetensors" for f in files)
    assert {f.name: f.stat().st_mode & 0o777 for f in files} == {f.name: 0o666 & ~current_umask() for f in files}


def test_ctrl_c_saves_and_resume_equals_uninterrupted_run(workdir, trained):
    out = workdir / "interrupted"
    # an eval after every step slows the run (not its losses) so the signal lands mid-run
    slow = ("--save-every", "100", "--eval-every", "1", "--eval-batches", "8")
    p = subprocess.Popen(LORAC + _train_args(workdir, out, 30, *slow), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while time.time() < deadline:
        time.sleep(0.01)
        if (out / "metrics.jsonl").exists() and sum('"loss"' in l for l in (out / "metrics.jsonl").read_text().splitlines()) >= 7:
            break
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 130, err[-2000:]  # a checkpoint is saved, and the status says the run is not done
    assert (out / "checkpoints" / "latest").is_file()
    stopped = max(r["step"] for r in _records(out) if "loss" in r)
    assert 7 <= stopped < 30
    r = _run(_train_args(workdir, out, 30, *slow, "--resume", str(out / "checkpoints")))
    assert r.returncode == 0, r.stderr[-2000:]
    got = {r["step"]: r["loss"] for r in _records(out) if "loss" in r}
    ref = {r["step"]: r["loss"] for r in _records(trained) if "loss" in r}
    assert sorted(got) == list(range(1, 31))
    for s in range(1, 31):
        assert abs(got[s] - ref[s]) <= 1e-6 * abs(ref[s]), (s, got[s], ref[s])


@pytest.mark.parametrize("extra,match", [
    (["--lr", "nan"], "--lr must be a finite number"),
    (["--steps", "0"], "--steps must be a positive integer"),
    (["--targets", "q_proj,fc9"], "fc9 not in a qwen3 model; valid targets"),
    (["--seq", "1"], "seq must be >= 2"),
    (["--scan-chunk", "-1"], "--scan-chunk must be an integer >= 0"),
    (["--scan-chunk", "2"], "--scan-chunk is for Mamba models"),
    (["--tune", "-1"], "--tune must be an integer >= 0"),
    (["--tune", "8", "--backend", "ort"], "--tune tunes TVM's kernels for --target cpu or cuda"),
])
def test_bad_flags_give_one_line(workdir, extra, match):
    r = _run(_train_args(workdir, workdir / "bad", 3, *extra))
    assert r.returncode == 2
    assert match in r.stderr and "Traceback" not in r.stderr
    assert not (workdir / "bad" / "checkpoints").exists()


def test_bad_inputs_give_one_line(workdir, trained, tmp_path):
    # missing model, empty dataset, a corrupt safetensors file, token ids beyond the model's vocab,
    # a checkpoint from another model
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (broken / f).write_bytes((workdir / "model" / f).read_bytes())
    (broken / "model.safetensors").write_bytes((workdir / "model" / "model.safetensors").read_bytes()[:1000])
    small = make_model_dir(tmp_path / "small_vocab", vocab_size=40)
    other = make_model_dir(tmp_path / "other", hidden_size=24, head_dim=6)
    cases = [
        (["--model", str(tmp_path / "nope")], "model not found"),
        (["--data", str(empty)], "empty"),
        (["--model", str(broken)], "model.safetensors"),
        (["--model", str(small)], "vocab"),
        (["--model", str(other), "--resume", str(trained / "checkpoints")], "another model"),
    ]
    for extra, match in cases:
        r = _run(_train_args(workdir, tmp_path / "o", 2, *extra))
        assert r.returncode == 2, (extra, r.stderr[-1500:])
        last = r.stderr.strip().splitlines()[-1]
        assert last.startswith("lorac: error:") and match in last, (extra, last)
        assert "Traceback" not in r.stderr


def test_eval_and_generate_commands(workdir, trained):
    r = _run(["eval", "--checkpoint", str(trained / "checkpoints"), "--data", str(workdir / "corpus.txt"),
              "--cache-dir", str(workdir / "cache")])
    assert r.returncode == 0, r.stderr[-2000:]
    adapted = json.loads(r.stdout)["eval_loss"]
    r = _run(["eval", "--model", str(workdir / "model"), "--data", str(workdir / "corpus.txt"), "--seq", "32",
              "--batch", "4", "--cache-dir", str(workdir / "cache")])
    assert r.returncode == 0, r.stderr[-2000:]
    assert adapted < json.loads(r.stdout)["eval_loss"]  # the adapter learned this corpus
    r = _run(["generate", "--checkpoint", str(trained / "checkpoints"), "--prompt", "the red cat", "--raw",
              "--max-new-tokens", "12", "--window", "32", "--cache-dir", str(workdir / "cache")])
    assert r.returncode == 0, r.stderr[-2000:]
    assert len(r.stdout.strip()) > 0
    r = _run(["generate", "--checkpoint", str(trained / "checkpoints"), "--prompt", "x", "--top-p", "0"])
    assert r.returncode == 2 and "--top-p" in r.stderr


def test_toml_config_supplies_defaults_and_flags_win(workdir, tmp_path):
    from lorac.runtime.cli import build_parser, train_config
    cfg_file = tmp_path / "run.toml"
    cfg_file.write_text('steps = 7\nbatch = 3\nloraplus-ratio = 8.0\ntargets = "q_proj,v_proj"\n')
    args = build_parser().parse_args(["train", "--config", str(cfg_file), "--batch", "5"])
    cfg = train_config(args)
    assert (cfg.steps, cfg.batch, cfg.loraplus_ratio, cfg.lora_targets) == (7, 5, 8.0, ("q_proj", "v_proj"))
    cfg_file.write_text("stepz = 3\n")
    r = _run(["train", "--config", str(cfg_file)])
    assert r.returncode == 2 and "unknown setting(s) stepz" in r.stderr


def test_compile_only_reads_no_weight_and_no_data(workdir, trained, monkeypatch):
    """--compile-only plans from the model's config and its safetensors header alone: it reads
    no weight and no training data, and its plan is the training run's (every graph it asks for
    is the one `trained` compiled into the cache, so nothing compiles here)."""
    from lorac.runtime import data
    from lorac.runtime.config import TrainConfig
    from lorac.runtime.model import weights
    from lorac.runtime.train.loop import train

    def refuse(*_a, **_k):
        raise AssertionError("--compile-only read a weight or the data")
    for module, name in ((weights, "load_safetensors"), (weights, "load_model"), (data, "load_dataset")):
        monkeypatch.setattr(module, name, refuse)
    logs = []
    cfg = TrainConfig(model=str(workdir / "model"), data=str(workdir / "corpus.txt"), out=str(workdir / "co"),
                      steps=30, batch=4, seq=32, lr=2e-3, eval_every=10, save_every=5, cache_dir=str(workdir / "cache"),
                      lora_targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
                      compile_only=True)
    got = train(cfg, log=logs.append)
    assert sorted(got["compiled"]) == ["adamw", "eval", "train"]
    assert all(Path(p).is_dir() for p in got["compiled"].values())
    assert not [line for line in logs if line.startswith("compiling")], logs


def test_dropped_rows_warn_and_truncate_prompt_left_keeps_them(workdir, tmp_path):
    # every other prompt ~90 characters (one token each; the others ~20) before 6-character answers,
    # rows of 32: without truncation a third of the rows hold prompt only, which the run says in one
    # warning line and summary.json; prompt-left cuts exactly the long prompts
    data = tmp_path / "long_prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": "the red cat sat. " * (1 + 4 * (i % 2)) + f"q{i}: ",
                                        "completion": f"mat {i % 10}."}) + "\n" for i in range(40)))
    for truncate in ("none", "prompt-left"):
        out = tmp_path / truncate
        r = _run(_train_args(workdir, out, 2, "--data", str(data), "--sample-tokens", "0", "--truncate", truncate))
        assert r.returncode == 0, r.stderr[-2000:]
        info = json.loads((out / "summary.json").read_text())["data"]
        line = next(l for l in r.stderr.splitlines() if l.startswith("data: "))
        assert line.startswith(f"data: {data}: {info['train_docs']} documents, {info['train_tokens']:,} tokens")
        warnings = [l for l in r.stderr.splitlines() if l.startswith("warning: ") and "rows" in l]
        assert "{" not in line and info["truncate"] == truncate and info["seq"] == 32
        if truncate == "none":
            left, total = info["train_rows_without_answer"], info["train_rows"] + info["train_rows_without_answer"]
            assert left > total // 3
            assert len(warnings) == 1 and warnings[0].startswith(
                f"warning: {left} of {total} training rows ({left / total:.0%}) ")
            assert "hold no answer token" in warnings[0] and "--truncate prompt-left" in warnings[0]
        else:
            assert warnings == [] and info["train_rows_without_answer"] == info["eval_rows_without_answer"] == 0
            assert info["train_prompts_cut"] == sum(1 for i in range(40) if i % 2) - info["eval_prompts_cut"] > 0
            assert info["train_pad_tokens"] > 0 and f"{info['train_prompts_cut'] + info['eval_prompts_cut']} " \
                "prompts cut" in line
