"""bench/cudnn_isolated_check.py with cuDNN's frontend emulated (tests/_cudnn_emulator.py): the
GPU check's stages run here first, so its one device call works the first time. The timings
are the emulator's and mean nothing; checked: every stage passes, --only runs just the named
speed variants (plain always), and an unknown name is refused before any stage runs. Each run
is a process of its own (the emulated check installs the emulator as the `cudnn` module)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CHECK = REPO / "bench" / "cudnn_isolated_check.py"
pytest.importorskip("torch")  # the check's buffers are torch tensors (on the CPU here)


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CHECK), "--emulate", *args], capture_output=True, text=True,
                          timeout=300, cwd=REPO)


def test_emulated_check_runs_only_the_named_variants(tmp_path):
    out = tmp_path / "report.json"
    r = _run("--speed", "--only", "bias", "--json", str(out))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    report = json.loads(out.read_text())
    speed = report["stages"]["speed"]
    assert {n: sorted(v) for n, v in speed["variants"].items()} == {"main": ["bias", "plain"],
                                                                     "short": ["bias", "plain"]}
    assert speed["variants"]["main"]["bias"]["ok"] and speed["engines"] == {}
    assert all(s["ok"] for s in report["stages"].values())


def test_unknown_variants_are_refused_before_any_stage():
    r = _run("--speed", "--only", "bias,biass")
    assert r.returncode == 2 and "== env" not in r.stdout
    assert "--only biass: not a variant; the variants: plain," in r.stderr
