"""A CUDA run ends on its summary: `lorac train --target cuda` and `lorac eval` free their cuDNN
plans and handle before Python's teardown (runtime/devices/cuda/attention.py release()), so
cuDNN's Python frontend (nanobind) prints no `nanobind: leaked ...` report at exit."""
import json
from pathlib import Path

import pytest

from conftest import run_lorac
from tiny_model import make_corpus, make_numpy_qwen3

pytest.importorskip("tvm")


def _unit_calls(cache: Path) -> list:
    return [c for m in cache.glob("*/manifest.json") for c in json.loads(m.read_text()).get("unit_calls", [])]


@pytest.mark.gpu  # skipped without a CUDA GPU (conftest.py)
def test_cuda_train_and_eval_end_without_a_nanobind_leak_report(tmp_path):
    pytest.importorskip("cudnn", reason="nvidia-cudnn-frontend (pip install 'lorac[cuda]')")
    model = make_numpy_qwen3(tmp_path / "model", head_dim=16)  # cuDNN's fused attention wants a multiple of 8
    corpus = make_corpus(tmp_path / "corpus.txt", 60)
    out, cache = tmp_path / "out", tmp_path / "cache"
    r = run_lorac(["train", "--target", "cuda", "--model", str(model), "--data", str(corpus), "--out", str(out),
                   "--steps", "2", "--batch", "2", "--seq", "32", "--eval-every", "2", "--sample-tokens", "0",
                   "--cache-dir", str(cache), "--progress", "lines"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert _unit_calls(cache), "the run did not use cuDNN's attention: nothing to test"
    assert "nanobind" not in r.stderr, "\n".join(r.stderr.splitlines()[-40:])
    assert json.loads(r.stdout)["steps"] == 2  # stdout is the summary and nothing after it
    r = run_lorac(["eval", "--target", "cuda", "--checkpoint", str(out / "checkpoints"), "--data", str(corpus),
                   "--cache-dir", str(cache)])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "nanobind" not in r.stderr, "\n".join(r.stderr.splitlines()[-40:])
    assert json.loads(r.stdout)["eval_loss"] > 0
