"""The README's first command, shortened: `lorac train` on the bundled SmolLM2-135M-Instruct and
Jargon File corpus compiles for this CPU, trains, and the eval loss drops."""
import json
import subprocess
import sys

import pytest

pytest.importorskip("tvm")


@pytest.mark.slow
def test_default_run_lowers_eval_loss(tmp_path):
    from lorac.runtime.model.default import default_gguf_path
    try:
        default_gguf_path()
    except ValueError as e:
        pytest.skip(str(e))
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "lorac.runtime.cli", "train", "--out", str(out), "--steps", "8",
                        "--eval-every", "8", "--sample-tokens", "12", "--cache-dir", str(tmp_path / "cache")],
                       capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["updates"] == 8 and summary["skipped"] == 0
    assert summary["eval_loss_after"] < summary["eval_loss_before"] - 0.05, summary
    assert summary["sample_base"] is not None and summary["sample_adapted"] is not None
    assert (out / "adapter" / "adapter_config.json").is_file()
    assert "eval loss:" in r.stderr and "sample (adapted)" in r.stderr
