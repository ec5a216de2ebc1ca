"""The CPU GEMM library (runtime/devices/cpu/blas.py, cblas.py, choice.py): every library it
finds and every split it may choose computes op(a) op(b) (and += with accumulate) as numpy
does, for each layout, batched and not, on row/column blocks of larger matrices; the
per-machine choice file is read back, and ignored when written for other libraries."""
import json
import subprocess
import sys

import numpy as np
import pytest

from lorac.runtime.devices.cpu import blas
from lorac.runtime.devices.cpu import cblas
from lorac.runtime.devices.cpu import choice

SHAPES = [(1, 64, 48, 32), (1, 300, 130, 70), (3, 40, 24, 16), (1, 16, 96, 200)]


def _operands(rng, ta, tb, batch, m, n, k):
    lead = (batch,) if batch > 1 else ()
    a = rng.standard_normal(lead + ((k, m) if ta else (m, k)), dtype=np.float32)
    b = rng.standard_normal(lead + ((n, k) if tb else (k, n)), dtype=np.float32)
    want = (np.swapaxes(a, -1, -2) if ta else a) @ (np.swapaxes(b, -1, -2) if tb else b)
    return a, b, want


def _libraries():
    libs = {"numpy": blas._Numpy()}
    for name, load in (("openblas", cblas.openblas), ("mkl", cblas.mkl)):
        lib = load()
        if lib is not None:
            libs[name] = lib
    return libs


@pytest.mark.parametrize("ta,tb", [(False, False), (False, True), (True, False), (True, True)])
def test_every_library_and_split_equals_numpy(ta, tb, monkeypatch):
    blas._setup()
    monkeypatch.setattr(blas, "_libs", _libraries())
    monkeypatch.setattr(blas, "_threads", 2)
    pool = blas._pool or blas.ThreadPoolExecutor(1)
    monkeypatch.setattr(blas, "_pool", pool)
    rng = np.random.default_rng(0)
    for shape in SHAPES:
        a, b, want = _operands(rng, ta, tb, *shape)
        for lib in blas._libs:
            for mode in ("whole", "rows", "cols"):
                if lib == "numpy" and mode != "whole":
                    continue
                out = np.full(want.shape, 7.0, np.float32)
                blas._run((lib, mode), ta, tb, a, b, out, 0.0)
                np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4, err_msg=f"{lib}/{mode} {shape}")
                blas._run((lib, mode), ta, tb, a, b, out, 1.0)
                np.testing.assert_allclose(out, 2 * want, rtol=1e-4, atol=2e-4, err_msg=f"{lib}/{mode} += {shape}")


def test_gemm_entry_chooses_once_and_accumulates(tmp_path):
    """The registered entry on DLPack tensors: a first call of a shape times the candidates and
    keeps one; an accumulating call's timing runs leave the output as it found it."""
    blas.use_cache_dir(tmp_path)
    rng = np.random.default_rng(1)
    a, b, want = _operands(rng, False, True, 1, 512, 384, 256)  # 100 MFLOP: split candidates too
    out = np.zeros(want.shape, np.float32)
    blas.gemm(False, True, a, b, out)
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)
    blas.gemm(False, True, a, b, out, accumulate=True)
    np.testing.assert_allclose(out, 2 * want, rtol=1e-4, atol=2e-4)
    saved = json.loads((tmp_path / choice.FILE).read_text())[choice._libraries]
    key = blas.shape_key(False, True, a.shape, b.shape, False)
    assert saved[key] == "/".join(choice.get(key)) and key + " +=" in saved
    lib, mode = choice.get(key)
    assert lib in blas._libs and mode in ("whole", "rows", "cols")


def test_choice_file_is_read_back_per_set_of_libraries(tmp_path):
    """A second process reads the choices of its own libraries (no timing), not another set's."""
    code = ("import sys; from lorac.runtime.devices.cpu import blas, choice; blas.use_cache_dir(sys.argv[1]); "
            "print(choice.get('nn 9x9 9x9'))")
    blas._setup()
    lib = next(iter(blas._libs))
    (tmp_path / choice.FILE).write_text(json.dumps({choice._libraries: {"nn 9x9 9x9": f"{lib}/cols"},
                                                    "another BLAS; threads=2": {"nn 9x9 9x9": "x/y"}}))
    run = lambda: subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                                 check=True).stdout.strip()
    assert run() == str((lib, "cols"))
    (tmp_path / choice.FILE).write_text(json.dumps({choice._libraries: {"nn 9x9 9x9": "nolib/cols"}}))
    assert run() == "None"  # a library this process does not have: timed anew
    (tmp_path / choice.FILE).write_text(json.dumps({"another BLAS; threads=2": {"nn 9x9 9x9": "x/y"}}))
    assert run() == "None"


def test_pick_keeps_the_candidate_that_took_least_cpu_time():
    """Ranked by CPU time: a candidate that waits (sleeps) costs nothing, one that computes costs."""
    import time

    def run(c):
        if c == ("l", "busy"):
            end = time.perf_counter() + 0.02
            while time.perf_counter() < end:
                pass
        else:
            time.sleep(0.05)
    assert choice.pick("test-a", [("l", "busy"), ("l", "waits")], run) == ("l", "waits")


def test_blas_info_names_the_kernel_family_openblas_runs():
    """blas_info reports OpenBLAS's kernel family, and says when OPENBLAS_CORETYPE forced it
    (a forced older family halves GEMM speed: docs/BENCHMARKS.md)."""
    import os
    if cblas.openblas() is None:
        pytest.skip("numpy here does not use OpenBLAS")
    code = "from lorac.runtime.devices.cpu.blas import blas_info; print(blas_info())"
    forced = subprocess.run([sys.executable, "-c", code], env={**os.environ, "OPENBLAS_CORETYPE": "Haswell"},
                            capture_output=True, text=True, check=True).stdout
    assert "core=Haswell" in forced and "(OPENBLAS_CORETYPE=Haswell)" in forced
    free = {k: v for k, v in os.environ.items() if not k.startswith("OPENBLAS_")}
    own = subprocess.run([sys.executable, "-c", code], env=free, capture_output=True, text=True, check=True).stdout
    assert "openblas: " in own and "core=" in own and "OPENBLAS_CORETYPE" not in own
