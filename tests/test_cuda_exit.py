"""A CUDA run ends on its summary: `lorac train --target cuda` and `lorac eval` free their cuDNN
plans and handle before Python's teardown (runtime/devices/cuda/attention.py release()), so
cuDNN's Python frontend (nanobind) prints no `nanobind: leaked ...` report at exit.

On a GPU machine whose TVM has no compiler (runtime only), compile the run's artifacts here
first and point the test at them (the tiny model is the same, seeded, on both machines):

    python tests/test_cuda_exit.py prepare CACHE          # here: --compile-only into CACHE
    LORAC_TEST_CUDA_CACHE=CACHE python -m pytest -m gpu tests/test_cuda_exit.py   # there
"""
import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from conftest import run_lorac  # noqa: E402
from tiny_model import make_corpus, make_numpy_qwen3  # noqa: E402


def _train_args(root: Path, cache: Path) -> list[str]:
    """The tiny run, its model and corpus made under root (head_dim 16: cuDNN's fused attention
    wants a multiple of 8)."""
    model = make_numpy_qwen3(root / "model", head_dim=16)
    corpus = make_corpus(root / "corpus.txt", 60)
    return ["train", "--target", "cuda", "--model", str(model), "--data", str(corpus), "--out", str(root / "out"),
            "--steps", "2", "--batch", "2", "--seq", "32", "--eval-every", "2", "--sample-tokens", "0",
            "--cache-dir", str(cache), "--progress", "lines"]


def _unit_calls(cache: Path) -> list:
    return [c for m in cache.glob("*/manifest.json") for c in json.loads(m.read_text()).get("unit_calls", [])]


@pytest.mark.gpu  # skipped without a CUDA GPU (conftest.py)
def test_cuda_train_and_eval_end_without_a_nanobind_leak_report(tmp_path):
    pytest.importorskip("tvm")
    pytest.importorskip("cudnn", reason="nvidia-cudnn-frontend (pip install '.[cuda]')")
    cache = Path(os.environ.get("LORAC_TEST_CUDA_CACHE") or tmp_path / "cache")
    r = run_lorac(_train_args(tmp_path, cache))
    assert r.returncode == 0, r.stderr[-3000:]
    assert _unit_calls(cache), "the run did not use cuDNN's attention: nothing to test"
    assert "nanobind" not in r.stderr, "\n".join(r.stderr.splitlines()[-40:])
    assert json.loads(r.stdout)["steps"] == 2  # stdout is the summary and nothing after it
    r = run_lorac(["eval", "--target", "cuda", "--checkpoint", str(tmp_path / "out" / "checkpoints"),
                   "--data", str(tmp_path / "corpus.txt"), "--cache-dir", str(cache)])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "nanobind" not in r.stderr, "\n".join(r.stderr.splitlines()[-40:])
    assert json.loads(r.stdout)["eval_loss"] > 0


if __name__ == "__main__" and sys.argv[1:2] == ["prepare"]:
    import tempfile
    cache = Path(sys.argv[2]).resolve()
    with tempfile.TemporaryDirectory() as root:
        r = run_lorac(_train_args(Path(root), cache) + ["--compile-only"])
    print(r.stdout if r.returncode == 0 else r.stderr[-3000:])
    sys.exit(r.returncode)
