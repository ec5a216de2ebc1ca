"""Hub ids for --model: resolved from the local Hugging Face cache with the hub unreachable
(HF_HUB_OFFLINE=1; the cache is laid out here as huggingface_hub lays it out), the GGUF file
of a quantization picked from a GGUF repo, and one clear line when the id is not cached."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from lorac.runtime.errors import LoracError
from lorac.runtime.model.hub import pick_gguf


def test_pick_gguf():
    files = ["README.md", "m-Q4_K_M.gguf", "m-Q6_K.gguf", "m-Q4_K_S.gguf", "m-IQ4_XS.gguf"]
    assert pick_gguf(files, None, "o/m") == "m-Q4_K_M.gguf"  # llama.cpp's default
    assert pick_gguf(files, "q6_k", "o/m") == "m-Q6_K.gguf"
    assert pick_gguf(["config.json", "model.safetensors"], None, "o/m") is None
    assert pick_gguf(["only.Q8_0.gguf"], None, "o/m") == "only.Q8_0.gguf"
    with pytest.raises(LoracError, match="no .gguf file for Q5_K_M; pick one as o/m:QUANT"):
        pick_gguf(files, "Q5_K_M", "o/m")
    with pytest.raises(LoracError, match="neither config.json nor .gguf"):
        pick_gguf(["README.md"], None, "o/m")


def cache_repo(cache, repo, files: dict, kind="models"):
    """A repo in huggingface_hub's cache layout: refs/main names a snapshot holding the files."""
    root = cache / f"{kind}--{repo.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(commit)
    snap = root / "snapshots" / commit
    snap.mkdir(parents=True)
    for name, data in files.items():
        (snap / name).parent.mkdir(parents=True, exist_ok=True)
        (snap / name).write_bytes(data)
    return snap


def resolve(cache, spec):
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    code = "import sys; from lorac.runtime.model.source import resolve_model; s = resolve_model(sys.argv[1]); print(s.path, s.name)"
    return subprocess.run([sys.executable, "-c", code, spec], env=env, capture_output=True, text=True, timeout=120)


def test_cached_repos_resolve_offline(tmp_path):
    from safetensors.numpy import save
    cache = tmp_path / "hub"
    hf = cache_repo(cache, "org/tiny", {"config.json": json.dumps({"model_type": "qwen3"}).encode(),
                                        "model.safetensors": save({"w": np.zeros(2, np.float32)})})
    gg = cache_repo(cache, "org/tiny-GGUF", {"tiny-Q4_K_M.gguf": b"GGUF", "tiny-Q6_K.gguf": b"GGUF"})
    r = resolve(cache, "org/tiny")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(hf), "org/tiny"]
    assert resolve(cache, "org/tiny-GGUF").stdout.split() == [str(gg / "tiny-Q4_K_M.gguf"), "org/tiny-GGUF"]
    assert resolve(cache, "org/tiny-GGUF:Q6_K").stdout.split() == [str(gg / "tiny-Q6_K.gguf"), "org/tiny-GGUF"]


def test_absent_repo_offline_is_one_line(tmp_path):
    data = tmp_path / "d.txt"
    data.write_text("hello\n")
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-m", "lorac.runtime.cli", "eval", "--model", "Qwen/Qwen3-0.6B", "--data",
                        str(data)], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert "Qwen/Qwen3-0.6B is neither a local path nor in the Hugging Face cache" in r.stderr
