"""CPU artifacts: numerics against onnxruntime, manifest, cache, wrong-artifact errors,
the CLI, and loading with TVM's runtime alone in a fresh process."""
from __future__ import annotations

import json
import re
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from _compiler_graphs import count_matmuls, assert_outputs_close, random_inputs, saved_training_graph, small_training_graph
from lorac.compiler import compile_graph
from lorac.runtime.engine.artifact import load_artifact
from lorac.runtime.errors import LoracError


@pytest.fixture(scope="module")
def graph(tmp_path_factory):
    return saved_training_graph(tmp_path_factory.mktemp("graph"))


@pytest.fixture(scope="module")
def art(graph, tmp_path_factory):
    path, _ = graph
    return compile_graph(path, target="cpu", out_dir=tmp_path_factory.mktemp("art") / "cpu")


def _ort_run(model, inputs):
    import onnxruntime as ort
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in model.graph.output]
    return dict(zip(names, sess.run(names, inputs)))


def test_matches_onnxruntime(graph, art):
    _, model = graph
    step = load_artifact(art, device="cpu")
    for seed in (0, 1):
        inputs = random_inputs(model, seed)
        out = step(inputs)
        assert_outputs_close(out, _ort_run(model, inputs), 1e-5)
        assert out["loss"].shape == () and all(np.abs(v).max() > 0 for v in out.values())


def test_bound_inputs_are_copied_into_the_steps_own_buffers(graph, art):
    """What a CUDA-graph step does with its inputs (artifact.Step.bound_inputs), exercised on a
    CPU artifact: one buffer per input, each call's values copied in, except a value that is
    that buffer (what upload returns); results equal the unbound step's on every call."""
    _, model = graph
    plain, bound = load_artifact(art, device="cpu"), load_artifact(art, device="cpu")
    bound.bound_inputs = True
    assert plain.manifest.bound_inputs is False
    frozen = [s for s in bound.inputs if s["name"] not in ("input_ids", "labels") and ".lora_" not in s["name"]]
    first = random_inputs(model, 2)
    weights = {s["name"]: first[s["name"]] for s in frozen}
    # weights uploaded once and passed back as they are, like the engine's
    uploads = {s["name"]: bound.upload(s, weights[s["name"]]) for s in frozen}
    assert all(bound._to_device(s, uploads[s["name"]]) is uploads[s["name"]] for s in frozen)
    for seed in (2, 3, 4):  # ids, labels and LoRA tensors change each call
        inputs = {**random_inputs(model, seed), **weights}
        got, want = bound({**inputs, **uploads}), plain(inputs)
        assert_outputs_close(got, want, 1e-6)
    buf = bound._buffers["input_ids"]
    dev_ids = plain.upload(next(s for s in plain.inputs if s["name"] == "input_ids"), inputs["input_ids"] * 0)
    assert bound._to_device(next(s for s in bound.inputs if s["name"] == "input_ids"), dev_ids) is buf
    assert (buf.numpy() == 0).all()  # a foreign device tensor is copied into the step's buffer

    class FailingVM:  # a capture that fails (driver, memory) is one error naming the way out
        def __getitem__(self, name):
            def main(*args):
                raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
            return main

    fresh = load_artifact(art, device="cpu")
    fresh.bound_inputs, fresh._vm = True, FailingVM()
    with pytest.raises(LoracError, match="not permitted when stream is capturing.*--no-cuda-graph"):
        fresh(random_inputs(model, 2))


def test_manifest(graph, art):
    path, model = graph
    m = json.loads((art / "manifest.json").read_text())
    import hashlib
    assert m["graph_sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert m["target"]["family"] == "cpu" and m["target"]["device"] == "cpu"
    assert m["target"]["tvm"]["kind"] == "llvm" and m["dtype"] == "float32"
    assert m["lorac_version"] and m["tvm_version"].startswith("0.27")
    assert [i["name"] for i in m["inputs"]] == [i.name for i in model.graph.input]
    assert [o["name"] for o in m["outputs"]] == [o.name for o in model.graph.output]
    ids = m["inputs"][0]
    assert ids == {"name": "input_ids", "shape": [2, 8], "dtype": "int64", "relax_name": "input_ids"}
    assert m["outputs"][0] == {"name": "loss", "shape": [], "dtype": "float32"}
    # every matmul went to BLAS, none is left to an untuned TVM kernel
    assert m["gemm"]["dispatched"] == count_matmuls(model) and m["units"] == [] and m["unit_calls"] == [] and m["gemm"]["left_to_tvm"] == []
    # the LoRA sums x W^T + u B^T run as accumulating GEMM calls (beta = 1), whose numbers
    # test_matches_onnxruntime checks
    assert any(n.startswith("lorac.gemm_acc_nt") for n in m["gemm"]["accumulating"])
    assert m["memory"]["static_plan_bytes"] > 0 and m["memory"]["runtime_allocations"] >= 0
    assert m["tune"] == 0  # part of the cache key: a --tune build never answers for an untuned one
    assert (art / m["library"]).is_file()


def test_cache_hit_builds_nothing(graph, art, monkeypatch):
    """A hit does no compiler work (what made it fast, without timing a shared host): no
    lowering, no build, the library untouched, and in a fresh process not even TVM imported."""
    from lorac.compiler import pipeline

    path, model = graph
    lib = art / "lib.so"
    before = lib.stat().st_mtime_ns

    def built(*a, **k):
        raise AssertionError("a cache hit compiled")

    monkeypatch.setattr(pipeline, "lower_to_relax", built)
    monkeypatch.setattr(pipeline, "_build_in_child", built)
    assert compile_graph(path, target="cpu", out_dir=art) == art
    assert compile_graph(model, target="cpu", out_dir=art) == art  # same bytes as a ModelProto
    assert lib.stat().st_mtime_ns == before
    code = ("import sys; from lorac.compiler import compile_graph; "
            f"assert str(compile_graph({str(path)!r}, target='cpu', out_dir={str(art)!r})) == {str(art)!r}; "
            "print(sorted(m for m in sys.modules if m == 'tvm' or m.startswith('tvm.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    assert lib.stat().st_mtime_ns == before
    with pytest.raises(AssertionError, match="a cache hit compiled"):  # the probe does catch a build
        compile_graph(path, target="cpu", out_dir=art, force=True)


def test_changed_graph_rebuilds(art, tmp_path):
    import shutil
    a = Path(shutil.copytree(art, tmp_path / "a"))
    sha = json.loads((a / "manifest.json").read_text())["graph_sha256"]
    compile_graph(small_training_graph(batch=1), target="cpu", out_dir=tmp_path / "a")
    m = json.loads((a / "manifest.json").read_text())
    assert m["graph_sha256"] != sha and m["inputs"][0]["shape"] == [1, 8]


def test_wrong_inputs_are_clear_errors(graph, art):
    _, model = graph
    step = load_artifact(art)
    good = random_inputs(model)
    cases = {
        "missing artifact input": {k: v for k, v in good.items() if k != "labels"},
        "unknown input": {**good, "model.bogus.weight": np.zeros(3, np.float32)},
        "shape [4, 8], artifact expects [2, 8]": {**good, "input_ids": np.zeros((4, 8), np.int64)},
        "dtype float32, artifact expects int64": {**good, "labels": good["labels"].astype(np.float32)},
        "values outside [0, 96)": {**good, "input_ids": good["input_ids"] + 96},
    }
    for msg, inputs in cases.items():
        with pytest.raises(LoracError, match=re.escape(msg)):
            step(inputs)


def test_wrong_artifact_is_a_clear_error(art, tmp_path):
    with pytest.raises(LoracError, match="not for device cuda"):
        load_artifact(art, device="cuda")
    with pytest.raises(LoracError, match="unknown device 'tpu'"):
        load_artifact(art, device="tpu")
    with pytest.raises(LoracError, match="no manifest.json"):
        load_artifact(tmp_path)
    with pytest.raises(LoracError, match="unknown target 'tpu'"):
        compile_graph(small_training_graph(), target="tpu", out_dir=tmp_path / "x")
    with pytest.raises(LoracError, match="supports dtype float32, not bfloat16"):
        compile_graph(small_training_graph(), target="cpu", out_dir=tmp_path / "x", dtype="bfloat16")


def test_runtime_only_process(graph, art, tmp_path):
    """A fresh process with TVM's runtime library only and torch made unimportable."""
    _, model = graph
    inputs = random_inputs(model, 3)
    np.savez(tmp_path / "in.npz", **inputs)
    want = _ort_run(model, inputs)
    script = f"""
import sys
sys.modules["torch"] = None          # as on a machine without torch
import numpy as np, tvm
assert not hasattr(tvm, "relax"), "compiler library was loaded"
from lorac.runtime.engine.artifact import load_artifact
step = load_artifact({str(art)!r}, device="cpu")
out = step(dict(np.load({str(tmp_path / 'in.npz')!r})))
np.savez({str(tmp_path / 'out.npz')!r}, **out)
print("modules:", "tvm.relax" in sys.modules, "onnxruntime" in sys.modules)
"""
    env = {**os.environ, "TVM_USE_RUNTIME_LIB": "1"}
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "modules: False False" in r.stdout
    got = dict(np.load(tmp_path / "out.npz"))
    assert_outputs_close(got, want, 1e-5)


def test_cli(graph, art, tmp_path, capsys):
    from lorac.compiler.cli import compile_command
    path, _ = graph
    with pytest.raises(SystemExit) as e:
        compile_command(["--help"])
    assert e.value.code == 0 and "--target" in capsys.readouterr().out
    assert compile_command([str(path), "--target", "cpu", "--out", str(art), "-q"]) == 0  # cache hit
    assert compile_command([str(tmp_path / "nope.onnx"), "--target", "cpu", "--out", str(tmp_path / "d")]) == 2
    assert "ONNX graph not found" in capsys.readouterr().err
    assert compile_command([str(path), "--target", "cpu", "--cuda-graph", "--out", str(tmp_path / "g")]) == 2
    assert "--cuda-graph is for --target cuda" in capsys.readouterr().err
