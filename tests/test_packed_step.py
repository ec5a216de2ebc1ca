"""bench/h200_packed_step.py's flow without a GPU (its `--stand-in cpu`: small CPU fp32
artifacts instead of the bf16 CUDA ones): prepare compiles and stores the equality's inputs
and its reference (each document alone), device runs the equality and the alternating timing
in processes of their own and prints a JSON line each. What it checks on the H200 (cuDNN's
packed attention in a whole step) needs the GPU; this keeps the lead's one GPU run from
failing on the script itself."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO

SCRIPT = REPO / "bench" / "h200_packed_step.py"


@pytest.mark.slow
def test_packed_step_bench_runs_on_a_cpu_stand_in(tmp_path):
    pytest.importorskip("tvm")
    cache = tmp_path / "cache"
    run = lambda *a: subprocess.run([sys.executable, str(SCRIPT), *a, "--stand-in", "cpu"], capture_output=True,  # noqa
                                    text=True, timeout=900, cwd=tmp_path)
    p = run("prepare", str(cache))
    assert p.returncode == 0, p.stderr[-3000:]
    prepared = json.loads((cache / "prepared.json").read_text())
    ref = prepared["cpu_fp32_isolated_vs_alone"]  # the CPU side of the equality: fp32, 1e-5
    assert prepared["documents"] > 4 and ref["loss_rel"] < 1e-5 and ref["min_cos"] > 1 - 1e-6 and ref["tensors"] == 28
    inputs = dict(np.load(cache / "equality_inputs.npz"))
    pos = inputs["check:position_ids"]
    assert (pos == 0).sum(1).tolist()[:2] == [4, 40]  # rows of 4 and 40 documents
    assert (inputs["check:labels"][pos == 0] == -100).all()
    out = tmp_path / "r.json"
    d = run("device", str(cache), "ragged", "bias", "--json", str(out))
    assert d.returncode == 0, d.stdout[-3000:] + d.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [r.get("equality", r.get("time")) for r in rows] == ["ragged", "ragged", "bias"]
    eq = rows[0]
    assert eq["ok"] and eq["loss_rel"] < 1e-5 and eq["min_cos"] > 0.99999
    for r in rows[1:]:
        assert r["ok"] and r["plain_ms"] > 0 and r["isolated_ms"] > 0 and len(r["round_ratios"]) == 10
        assert r["per_row"] == 40 and r["documents_per_row"][:2] == [4, 40]
    assert "| ragged (time) | plain" in d.stdout
