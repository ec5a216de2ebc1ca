"""A plain install works: lorac's wheel goes into a fresh venv with no extras (offline, from a
folder of wheels: tests/wheelhouse.py) and `lorac train --steps 2` runs there on a tiny model,
compiling its graphs with the TVM that the core dependencies bring."""
import json
import os
import subprocess
import sys
import venv

import pytest

pytest.importorskip("tvm")
pytest.importorskip("transformers")  # makes the tiny model


@pytest.mark.slow
def test_plain_install_trains(tmp_path):
    from tiny_model import make_corpus, make_model_dir
    from wheelhouse import build_wheelhouse
    wheels = build_wheelhouse(tmp_path / "wheels")
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    bindir = env_dir / ("Scripts" if os.name == "nt" else "bin")
    py = bindir / "python"
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON"))}
    r = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-index", "--find-links", str(wheels), "lorac"],
                       env={**clean, "PIP_CONFIG_FILE": os.devnull}, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    r = subprocess.run([str(py), "-c", "import importlib.util as u; print([m for m in ('torch', 'transformers', "
                        "'onnxruntime', 'datasets') if u.find_spec(m)])"], capture_output=True, text=True, env=clean)
    assert r.stdout.strip() == "[]", r.stdout  # no test oracle or optional extra came along

    model = make_model_dir(tmp_path / "model", layers=1)
    corpus = make_corpus(tmp_path / "corpus.txt", n=40)
    out = tmp_path / "out"
    r = subprocess.run([str(bindir / "lorac"), "train", "--model", str(model), "--data", str(corpus), "--steps", "2",
                        "--batch", "1", "--seq", "16", "--rank", "2", "--eval-batches", "0", "--sample-tokens", "0",
                        "--out", str(out), "--cache-dir", str(tmp_path / "cache")],
                       cwd=tmp_path, env={**clean, "MPLCONFIGDIR": str(tmp_path / "mpl")},
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["updates"] == 2
    assert (out / "adapter" / "adapter_model.safetensors").is_file() and (out / "loss.png").is_file()
