"""A CLI that feels familiar: TRL/PEFT flag spellings (and underscores) as aliases, in flags and
in TOML; a tqdm bar for steps and for compiling; TensorBoard scalars; the loss plot drawn by
matplotlib; no TVM fast-mode warning while compiling; transformers' repetition penalty."""
import json
import struct
import subprocess
import sys

import numpy as np
import pytest

from lorac.runtime.cli import build_parser, main, train_config
from tiny_model import make_corpus, make_model_dir

from conftest import LORAC  # noqa: E402 - the `lorac` command (tests/conftest.py)


def parsed(argv):
    from lorac.runtime.cli import _dashes
    return train_config(build_parser().parse_args([_dashes(a) for a in argv]))


def test_trl_and_peft_spellings(tmp_path):
    cfg = parsed(["train", "--learning_rate", "1e-3", "--max-steps", "5", "--lora-r", "4", "--lora_alpha", "8",
                  "--max-seq-length=64", "--per-device-train-batch-size", "2", "--gradient-accumulation-steps", "3",
                  "--output_dir", "o", "--target-modules", "q_proj,v_proj", "--use-rslora", "--warmup-steps", "1"])
    assert (cfg.lr, cfg.steps, cfg.rank, cfg.alpha, cfg.seq, cfg.batch, cfg.grad_accum, cfg.out, cfg.lora_targets,
            cfg.rslora, cfg.warmup) == (1e-3, 5, 4, 8.0, 64, 2, 3, "o", ("q_proj", "v_proj"), True, 1)
    toml = tmp_path / "run.toml"
    toml.write_text('learning_rate = 5e-4\nmax_steps = 9\nlora-r = 2\n')
    cfg = parsed(["train", "--config", str(toml)])
    assert (cfg.lr, cfg.steps, cfg.rank) == (5e-4, 9, 2)
    text = build_parser()._subparsers._group_actions[0].choices["train"].format_help()
    assert "--lr LR, --learning-rate LR" in text or "--lr, --learning-rate LR" in text  # Python 3.13 shows one metavar
    assert "--lora-r" in text and "--max-seq-length" in text and "--gradient-accumulation-steps" in text


def test_bad_progress_and_report_settings_are_one_line(capsys):
    assert main(["train", "--progress", "fancy"]) == 2
    assert main(["train", "--report-to", "wandb"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == ["lorac: error: --progress must be one of auto, bar, lines, got 'fancy'",
                   "lorac: error: --report-to takes none or tensorboard, got wandb"]


def read_events(folder):
    """Scalars (tag -> [(step, value)]) from TensorBoard event files: TFRecord framing (u64 length,
    u32 crc, payload, u32 crc) around Event protos."""
    from tensorboardX.proto.event_pb2 import Event
    scalars = {}
    for path in sorted(folder.rglob("events.out.tfevents.*")):
        data = path.read_bytes()
        at = 0
        while at < len(data):
            (n,) = struct.unpack("<Q", data[at:at + 8])
            event = Event.FromString(data[at + 12:at + 12 + n])
            at += 12 + n + 4
            for v in event.summary.value:
                scalars.setdefault(v.tag, []).append((event.step, v.simple_value))
    return scalars


@pytest.mark.slow
def test_progress_bar_tensorboard_and_plot(tmp_path):
    pytest.importorskip("tvm")
    pytest.importorskip("tensorboardX")
    model = make_model_dir(tmp_path / "model", layers=1)
    corpus = make_corpus(tmp_path / "corpus.txt", 60)
    out = tmp_path / "out"
    r = subprocess.run(LORAC + ["train", "--model", str(model), "--data", str(corpus), "--out", str(out), "--steps", "4",
                                "--batch", "2", "--seq", "16", "--eval-every", "2", "--sample-tokens", "0",
                                "--cache-dir", str(tmp_path / "cache"), "--progress", "bar", "--report-to",
                                "tensorboard"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "compiling: 100%" in r.stderr and "4/4" in r.stderr and "loss=" in r.stderr and "tok_s=" in r.stderr
    assert "step     1/4 |" not in r.stderr  # the bar replaces the per-step lines
    assert "Fast mode segfaults" not in r.stderr  # TVM's warning on the embedding gather
    scalars = read_events(out / "runs")
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert scalars["train/loss"] == [(m["step"], pytest.approx(m["loss"])) for m in metrics if "loss" in m]
    assert [s for s, _ in scalars["eval/loss"]] == [0, 2, 4]
    assert {"train/learning_rate", "train/grad_norm", "train/tokens_per_second"} <= set(scalars)
    png = (out / "loss.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", png[16:24]) == (720, 400)


def test_loss_plot_draws_every_series(tmp_path):
    from lorac.runtime.train.plot import plot_metrics
    from matplotlib.image import imread
    recs = [{"step": 0, "eval_loss": 3.0}] + [{"step": s, "loss": 3.0 - 0.1 * s, "lr": 1e-4 * min(1, s / 3)}
                                              for s in range(1, 11)] + [{"step": 10, "eval_loss": 2.2}]
    (tmp_path / "m.jsonl").write_text("\n".join(json.dumps(r) for r in recs))
    img = imread(plot_metrics(tmp_path / "m.jsonl", tmp_path / "p.png"))
    assert img.shape[:2] == (400, 720)
    rgb = (img[..., :3] * 255).round().astype(int).reshape(-1, 3)
    colors = {tuple(c) for c in rgb}
    assert (31, 119, 180) in colors and (214, 39, 40) in colors  # tab:blue train, tab:red eval


def test_repetition_penalty_matches_transformers():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from lorac.runtime.generate import penalize_repeats
    logits = np.random.default_rng(0).standard_normal(50)
    seen = [3, 7, 7, 20, 41]
    want = transformers.RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([seen]), torch.tensor(logits[None]))
    np.testing.assert_allclose(penalize_repeats(logits, seen, 1.3), want[0].numpy(), rtol=1e-12)
    assert penalize_repeats(logits, seen, 1.0) is logits
