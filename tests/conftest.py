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
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"
LORAC = [sys.executable, "-m", "lorac.runtime.cli"]  # the `lorac` command, in this interpreter

UNIT = {
    "test_cache_keys.py", "test_chat_template.py", "test_cpu_blas.py", "test_cpu_schedule.py", "test_data_formats.py",
    "test_defaults.py", "test_embeddings_quant.py", "test_fuzz.py", "test_fuzz_bytes.py", "test_gguf_spm.py",
    "test_graph_errors.py", "test_kquants.py", "test_layers.py", "test_ort_webgpu.py", "test_packed_documents.py",
    "test_portability.py", "test_quant_formats.py", "test_tiers.py", "test_train_cleanup.py", "test_units.py",
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


# -- writes confined to a test's folder (the fuzz tests: tests/test_fuzz*.py) ------------------------
_CONFINED: dict = {"roots": None, "outside": []}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
# event -> [(index of a path argument, index of its dir_fd argument or None)]
_PATH_EVENTS = {"os.rename": [(0, 2), (1, 3)], "os.remove": [(0, 1)], "os.rmdir": [(0, 1)], "os.mkdir": [(0, 2)],
                "shutil.rmtree": [(0, 1)], "os.symlink": [(1, 2)], "os.link": [(1, 3)], "os.truncate": [(0, None)],
                "os.chmod": [(0, 2)]}


def _resolve(path, dir_fd) -> str:
    """An audited path as an absolute one (relative to its dir_fd, as shutil.rmtree passes them)."""
    path = os.fsdecode(path)
    if isinstance(dir_fd, int) and dir_fd >= 0 and not os.path.isabs(path):
        try:
            path = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path)
        except OSError:
            pass
    return os.path.realpath(path)


def _audit(event: str, args) -> None:
    """An audit hook (PEP 578): every file opened for writing, renamed, removed or made while
    _CONFINED["roots"] is set must lie below one of them; others are recorded in "outside"."""
    roots = _CONFINED["roots"]
    if roots is None:
        return
    if event == "open":
        path, mode, flags = args
        if not (isinstance(mode, str) and any(c in mode for c in "wax+")) and not (isinstance(flags, int) and flags & _WRITE_FLAGS):
            return
        paths = [(path, None)]
    elif event in _PATH_EVENTS:
        paths = [(args[i], args[j] if j is not None and j < len(args) else None) for i, j in _PATH_EVENTS[event]]
    else:
        return
    for p, dir_fd in paths:
        if isinstance(p, (str, bytes, os.PathLike)):
            real = _resolve(p, dir_fd)
            if "__pycache__" not in real and not any(real == r or real.startswith(r + os.sep) for r in roots):
                _CONFINED["outside"].append(f"{event} {real}")


sys.addaudithook(_audit)


@pytest.fixture
def confined(tmp_path, monkeypatch):
    """The test may write only inside tmp_path: the temporary directory is moved there (lorac's data
    folders go to it) and an audit hook records any write elsewhere, which fails the test."""
    import tempfile
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    _CONFINED.update(roots=(os.path.realpath(tmp_path),), outside=[])
    try:
        yield tmp_path
    finally:
        _CONFINED["roots"] = None
    assert not _CONFINED["outside"], f"written outside the test's folder: {_CONFINED['outside'][:5]}"


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
