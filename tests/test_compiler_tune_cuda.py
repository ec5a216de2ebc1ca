"""`--tune` on the CUDA target (compiler/targets/cuda/tuning.py) without a GPU: the kernels to tune are
the fused kernels the build schedules itself (lorac's own TIR units are not), a machine with
no GPU is refused only while kernels are missing from the database, and, where nvcc exists,
the whole path with stand-in timings: candidates built through nvcc, the database written
as kernels finish, the kept schedules in the artifact, a second compile measuring nothing.
Timing real candidates needs the GPU: bench/h200_tune.py (docs/BENCHMARKS.md)."""
from __future__ import annotations

import dataclasses
import json
import logging
import random
import shutil

import pytest

from _compiler_graphs import saved_training_graph, small_training_graph
from lorac.compiler import compile_graph
from lorac.compiler.targets.cuda import tuning as cuda_tune
from lorac.compiler.targets import cuda as target_cuda
from lorac.compiler import tune
from lorac.runtime.errors import LoracError

tvm = pytest.importorskip("tvm")


def _no_gpu(monkeypatch):
    monkeypatch.setattr(cuda_tune, "TUNER", dataclasses.replace(cuda_tune.TUNER, device=lambda: None))


def test_cuda_tuning_needs_the_gpu_only_for_kernels_not_in_the_database(tmp_path, monkeypatch):
    from lorac.compiler.pipeline import lower_to_relax

    _no_gpu(monkeypatch)
    mod, _, _, _ = lower_to_relax(small_training_graph(), target_cuda, "bfloat16")
    target = target_cuda.tvm_target({"kind": "cuda"})
    tasks = tune._fused_tasks(mod, target, target_cuda.relax_passes)
    assert tasks and all(not tune._scheduled(t.dispatched[0]["main"]) for t in tasks)

    with pytest.raises(LoracError, match=r"^tuning cuda kernels needs the device they run on, and this machine "
                                         r"has none: 2 of the 2 kernels to tune are not in .*cuda-tuning\.json"):
        target_cuda.tune(mod, target, 16, tmp_path)
    assert not (tmp_path / "cuda-tuning.json").exists()

    # every kernel that 16 trials would tune is in the database (measured elsewhere): no device needed
    ranked = sorted(tasks, key=lambda t: -tune._bytes(t) * t.weight)[:2]
    key = tune._key(target, cuda_tune.TUNER)
    tune._write(tmp_path / "cuda-tuning.json", key, {tune._hash(t.dispatched[0]): {"task": t.task_name, "record": None}
                                                     for t in ranked})
    out = target_cuda.tune(mod, target, 16, tmp_path)
    assert out.attrs[tune._ATTR] == str((tmp_path / "cuda-tuning.json").resolve())


@pytest.mark.skipif(shutil.which("nvcc") is None and target_cuda._nvcc() is None, reason="needs nvcc (CUDA toolkit)")
def test_cuda_tuning_builds_candidates_and_applies_kept_schedules(tmp_path, monkeypatch, caplog):
    """Stand-in timings (random, every tuned schedule kept) on this GPU-less machine; the
    candidates and the artifact are real nvcc builds."""
    from tvm.s_tir.meta_schedule.runner import utils as runner_utils

    monkeypatch.setattr(cuda_tune, "TUNER", dataclasses.replace(cuda_tune.TUNER, device=lambda: tvm.cpu(0)))
    rng = random.Random(0)
    monkeypatch.setattr(runner_utils, "run_evaluator_common", lambda *a, **k: [rng.uniform(1e-6, 2e-6)])
    monkeypatch.setattr(tune, "_MARGIN", float("-inf"))
    caplog.set_level(logging.INFO, logger="lorac.compiler.tune")
    path, _ = saved_training_graph(tmp_path)
    request = {"kind": "cuda", "cuda_graph": True}
    plain = compile_graph(path, target=request, dtype="bfloat16", out_dir=tmp_path / "plain")
    tuned = compile_graph(path, target=request, dtype="bfloat16", out_dir=tmp_path / "tuned", tune=16)

    db_path = tmp_path / ".lorac-tuning" / cuda_tune.DATABASE
    (section,) = json.loads(db_path.read_text()).values()
    assert len(section) == 2
    assert all(e["record"] and e["trials"] == 8 and e["calls"] >= 1 and e["tuned_us"] > 0 for e in section.values())
    assert "applied 2 tuned kernel schedules" in caplog.text

    def sha(art):
        return json.loads((art / "manifest.json").read_text())["extra"]["cuda_source_sha256"]

    assert sha(tuned) != sha(plain)  # the kept schedules are in the kernels shipped

    def no_tuning(*_a, **_k):
        raise AssertionError("the second compile tuned again")

    monkeypatch.setattr(tune, "_tune_tasks", no_tuning)
    _no_gpu(monkeypatch)  # nothing to measure: no device needed
    before = db_path.read_bytes()
    again = compile_graph(path, target=request, dtype="bfloat16", out_dir=tmp_path / "tuned", tune=16, force=True)
    assert db_path.read_bytes() == before and sha(again) == sha(tuned)
