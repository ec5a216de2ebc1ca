"""The aarch64 artifact, cross-compiled here, runs in an arm64 Linux user space under QEMU
user-mode emulation (the arm64 python3 of Debian, the aarch64 apache-tvm and numpy wheels,
lorac's runtime), and its loss and gradients equal the x86-64 artifact's to 1e-5.

Needs `scripts/setup_aarch64.sh` (the arm64 root, default .venv/aarch64-root, or
$LORAC_AARCH64_ROOT), qemu-aarch64-static and the cross linker aarch64-linux-gnu-gcc;
skips naming what is missing (CI has no root: it does not run debootstrap)."""
from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from _compiler_graphs import random_inputs, small_training_graph

REPO = Path(__file__).resolve().parents[1]
ROOT = Path(os.environ.get("LORAC_AARCH64_ROOT", REPO / ".venv" / "aarch64-root"))
SITE = ROOT / "opt" / "lorac-site"  # the aarch64 wheels (setup_aarch64.sh)

GUEST = """
import json, platform, sys, time
import numpy as np
from lorac.runtime import load_artifact
t0 = time.perf_counter()
step = load_artifact(sys.argv[1], "cpu")
t1 = time.perf_counter()
out = step(dict(np.load(sys.argv[2])))
t2 = time.perf_counter()
np.savez(sys.argv[3], **out)
print(json.dumps({"machine": platform.machine(), "load_s": round(t1 - t0, 2), "step_s": round(t2 - t1, 2)}))
"""


def _missing() -> str | None:
    if shutil.which("qemu-aarch64-static") is None:
        return "qemu-aarch64-static is not installed (Debian: qemu-user-static; scripts/setup_aarch64.sh)"
    if shutil.which("aarch64-linux-gnu-gcc") is None:
        return "the cross linker aarch64-linux-gnu-gcc is not installed (Debian: gcc-aarch64-linux-gnu)"
    if not (ROOT / "usr" / "bin" / "python3").exists() or not (SITE / "tvm").is_dir():
        return f"no arm64 root at {ROOT} (make it with scripts/setup_aarch64.sh)"
    return None


def _lorac_tree(folder: Path) -> Path:
    """An importable `lorac` package holding only what the runtime needs (links into the repo)."""
    pkg = folder / "lorac"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").symlink_to(REPO / "lorac_pkg" / "__init__.py")
    (pkg / "runtime").symlink_to(REPO / "runtime")
    return folder


@pytest.mark.slow
def test_aarch64_artifact_under_qemu_equals_the_x86_64_artifact(tmp_path):
    why = _missing()
    if why:
        pytest.skip(why)
    from lorac.compiler import compile_graph
    from lorac.runtime import load_artifact

    graph = small_training_graph()
    inputs = random_inputs(graph, seed=5)
    arm = compile_graph(graph, target="aarch64", out_dir=tmp_path / "arm")
    want = load_artifact(compile_graph(graph, target="cpu", out_dir=tmp_path / "x86"), "cpu")(inputs)
    np.savez(tmp_path / "in.npz", **inputs)

    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENBLAS_", "PYTHON", "LD_"))}
    env.update(PYTHONPATH=f"{_lorac_tree(tmp_path / 'src')}:{SITE}", TVM_USE_RUNTIME_LIB="1", TVM_NUM_THREADS="2")
    t0 = time.perf_counter()
    r = subprocess.run(["qemu-aarch64-static", "-L", str(ROOT), str(ROOT / "usr" / "bin" / "python3"), "-c", GUEST,
                        str(arm), str(tmp_path / "in.npz"), str(tmp_path / "out.npz")],
                       env=env, capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - t0
    assert r.returncode == 0, r.stderr[-3000:]
    guest = json.loads(r.stdout.strip().splitlines()[-1])
    assert guest["machine"] == "aarch64"
    got = dict(np.load(tmp_path / "out.npz"))
    assert set(got) == set(want) and len(want) > 1  # the loss and every LoRA gradient
    err = {n: float(np.abs(got[n] - w).max() / max(np.abs(w).max(), 1e-30)) for n, w in want.items()}
    print(json.dumps({"host": platform.machine(), **guest, "emulated_wall_s": round(wall, 1), "outputs": len(err),
                      "loss_x86_64": float(want["loss"]), "loss_aarch64": float(got["loss"]),
                      "max_rel_diff_loss": err["loss"], "max_rel_diff_grads": max(v for n, v in err.items() if n != "loss")}))
    assert max(err.values()) <= 1e-5, sorted(err.items(), key=lambda kv: -kv[1])[:3]
