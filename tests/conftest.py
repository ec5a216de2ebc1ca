"""The suite's tiers and the helpers several test files share.

Tiers (pytest markers; docs/TESTING.md has the times):
    unit         one module at a time: no compiled artifact, no training run, no oracle
                 model, no child process; the whole tier runs in well under a minute
    integration  everything else on a CPU: compiles, trains, exports, the PyTorch /
                 onnxruntime / llama.cpp oracles, CLI subprocesses, MPI workers
    gpu          needs a CUDA GPU (marked in the test file); skipped where none is present

    pytest -m unit                  the fast tier
    pytest -m "not gpu"             what CI runs in effect (gpu tests skip there anyway)
    pytest                          everything

A test file is unit when it is named in UNIT below (tests/test_tiers.py keeps the list
true: every name a test file, none of them compiling or training); any other file is
integration, and a test marked gpu is gpu whatever its file.
"""
from __future__ import annotations

import ctypes
import functools
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"
LORAC = [sys.executable, "-m", "lorac.runtime.cli"]  # the `lorac` command, in this interpreter

UNIT = {
    "test_cache_keys.py", "test_chat_template.py", "test_cpu_schedule.py", "test_data_formats.py",
    "test_defaults.py", "test_fuzz.py", "test_gguf_spm.py", "test_graph_errors.py",
    "test_layers.py", "test_ort_webgpu.py", "test_portability.py", "test_quant_formats.py", "test_tiers.py",
    "test_train_cleanup.py", "test_units.py",
}
TIERS = ("unit", "integration", "gpu")


@functools.cache
def has_cuda_gpu() -> bool:
    """A CUDA driver and at least one GPU that nvidia-smi lists."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    r = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True) if shutil.which("nvidia-smi") else None
    return bool(r and r.returncode == 0 and "GPU" in r.stdout)


def run_lorac(args: list[str], **kw) -> subprocess.CompletedProcess:
    """`lorac ARGS` in a child process (text output captured, 10 minutes at most)."""
    return subprocess.run(LORAC + list(args), capture_output=True, text=True, timeout=kw.pop("timeout", 600), **kw)


def tier_of(item) -> str:
    if item.get_closest_marker("gpu"):
        return "gpu"
    return "unit" if Path(str(item.fspath)).name in UNIT else "integration"


def pytest_collection_modifyitems(config, items):
    for item in items:
        item.add_marker(getattr(pytest.mark, tier_of(item)))


def pytest_runtest_setup(item):
    if item.get_closest_marker("gpu") and not has_cuda_gpu():
        pytest.skip("no CUDA GPU")
