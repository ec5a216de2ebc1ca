"""bench/webgpu_profile.py (and bench/webgpu_gemms.py) with the CPU standing in for the WebGPU
adapter (tests/webgpu_stand_in.py): every part of the one GPU call runs here first, so that
call works the first time. The timings are the CPU's and mean nothing; what is checked is that
each part ran, what reached the sessions, and the exactness bookkeeping."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
pytest.importorskip("onnxruntime")
sys.path.insert(0, str(REPO / "bench"))
import webgpu_profile as wp  # noqa: E402


def test_fp16_gemms_put_every_matmul_on_fp16_operands():
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
                           helper.make_node("MatMul", ["r", "w"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8]),
                           helper.make_tensor_value_info("w", TensorProto.FLOAT, [8, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])])
    m = wp.fp16_gemms(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=9))
    onnx.checker.check_model(m, full_check=True)
    casts = [n for n in m.graph.node if n.op_type == "Cast"]
    to = {n.output[0]: n.attribute[0].i for n in casts}
    assert len(casts) == 5  # x, w (shared by both), r to fp16; both products back
    for mm in (n for n in m.graph.node if n.op_type == "MatMul"):
        assert all(to.get(x) == TensorProto.FLOAT16 for x in mm.input)
    x, w = np.random.default_rng(0).standard_normal((2, 4, 8)).astype(np.float32)[0], np.eye(8, dtype=np.float32)
    s = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(s.run(None, {"x": x, "w": w})[0], np.maximum(x, 0), rtol=1e-3, atol=1e-3)


def test_gemm_shapes_are_read_back_from_a_profile():
    from webgpu_gemms import _gemm_node as read
    assert read({"op": "MatMul", "inputs": [[2, 64, 32], [32, 16]], "output": [[2, 64, 16]]})[3] == 2 * 2 * 64 * 16 * 32
    g, shapes, out, flop = read({"op": "Gemm", "inputs": [[64, 16], [32, 16], [64, 32]], "output": [[64, 32]]})
    assert [(a.name, a.i) for a in g.node[0].attribute] == [("transA", 0), ("transB", 1)] and flop == 2 * 64 * 32 * 16
    g, _, _, _ = read({"op": "FusedMatMul", "inputs": [[64, 32], [64, 16]], "output": [[32, 16]]})
    assert g.node[0].domain == "com.microsoft" and [a.i for a in g.node[0].attribute] == [1, 0]
    assert read({"op": "Gemm", "inputs": [[4, 5], [6, 7]], "output": [[4, 7]]}) is None  # no reading fits
    assert read({"op": "MatMulNBits", "inputs": [[4, 5], [6, 7]], "output": [[4, 7]]}) is None


def test_the_device_call_runs_with_the_cpu_standing_in(tmp_path):
    """Profile (1x64), the MatMuls alone, four variants (2x32), the faster exact ones together at
    the profile case (--faster 100: every exact step variant counts as faster)."""
    r = subprocess.run([sys.executable, str(REPO / "bench" / "webgpu_profile.py"), "device", str(tmp_path), "--stand-in",
                        "--case", "tiny-2x32", "--profile-case", "tiny-1x64", "--steps", "2", "--faster", "100",
                        "--variants", "base,validation-off,train-only,graph-capture,fp16-gemm"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads((tmp_path / "profile.json").read_text())
    assert "| validation-off |" in r.stdout and (tmp_path / "children.log").is_file()
    prof = s["profile"]
    assert prof["case"] == "tiny-1x64" and prof["step_ms"] > 0 and prof["profiled_step_ms"] > 0
    assert len(prof["losses"]) == 6 and prof["adapter"]["vendor"] == "stand-in"
    train = prof["profile"]["train"]
    assert (train["runs"], train["timed_runs"]) == (3, 2) and train["kernels_per_run"] > 100
    assert train["gpu_kernel_events"] == 0 and "gpu_ms_per_run" not in train  # the CPU writes none
    assert train["cpu_top_ops"] and all(x["ms_per_step"] >= 0 for x in train["cpu_top_nodes"])
    assert train["matmul_shapes"] and all(x["count"] >= 1 for x in train["matmul_shapes"])
    alone = s["matmul_alone"]
    assert alone["timed"] == len(train["matmul_shapes"]) and alone["matmul_ms_per_step"] > 0
    assert alone["flop_share_timed"] == 1.0 and all(r["on"] for r in alone["shapes"])
    v = s["variants"]
    assert set(v) == {"base", "validation-off", "train-only", "graph-capture", "fp16-gemm"}
    assert v["fp16-gemm"]["fp16_matmuls"] > 10 and sum(v["fp16-gemm"]["matmuls_on"].values()) > 0
    assert v["fp16-gemm"]["grad_cos_vs_base"] > 0.999  # the CPU drops the casts (no fp16 MatMul): exact here
    assert v["validation-off"]["session_got"]["validationMode"] == "disabled"  # as ort_webgpu.DEFAULTS passes it
    assert v["graph-capture"]["session_got"]["enableGraphCapture"] == "1"
    assert v["validation-off"]["losses"] == v["base"]["losses"] and v["validation-off"]["grad_cos_vs_base"] == 1.0
    # the replays: the same batches as the full steps' first, each run's batch copied into the device buffers
    assert v["train-only"]["losses"][0] == v["base"]["losses"][0] and v["train-only"]["grad_rel_vs_base"] == 0
    assert len(set(v["train-only"]["losses"][:4])) == 4
    assert v["graph-capture"]["compared_with"] == "train-only" and v["graph-capture"]["loss_rel_vs_base"] == 0
    assert s["faster_exact"] == ["validation-off"]
    assert s["best_options"] == {"ep": {"validationMode": "disabled"}, "session": {}}
    best = s["profile_case_best"]
    assert best["case"] == "tiny-1x64" and best["session_got"]["validationMode"] == "disabled"
    assert best["loss_rel_vs_base"] == 0 and best["losses"] == prof["losses"][:3]


def test_parts_by_difference_run_with_the_cpu_standing_in(tmp_path):
    """bench/webgpu_parts.py: the base, attention as identities (a different step: not compared),
    and candidates compared with the base: the lean attention bodies and the unfused GEMMs equal it
    on the CPU, the fp16 graph within fp16's rounding, the 16-token loss chunks to fp32 rounding."""
    runs = ["base", "no-attention", "lean", "unfused", "fp16", "chunk16"]
    r = subprocess.run([sys.executable, str(REPO / "bench" / "webgpu_parts.py"), "device", str(tmp_path), "--stand-in",
                        "--steps", "2", "--runs", ",".join(f"tiny-2x32:{v}" for v in runs)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads((tmp_path / "parts.json").read_text())
    assert set(got) == {f"tiny-2x32:{v}" for v in runs}
    base = got["tiny-2x32:base"]
    assert len(base["losses"]) == 4 and base["step_ms"] > 0
    assert "loss_rel_vs_base" not in got["tiny-2x32:no-attention"]
    assert got["tiny-2x32:no-attention"]["losses"] != base["losses"]  # attention taken out changes the model
    for v in ("lean", "unfused", "chunk16"):
        rec = got[f"tiny-2x32:{v}"]
        assert rec["loss_rel_vs_base"] <= 1e-5 and rec["grad_cos_vs_base"] >= 0.99999, v
    assert got["tiny-2x32:unfused"]["gemm_ops"]["CPUExecutionProvider"].get("Gemm", 0) == 0  # no Gemm fusion left
    assert base["gemm_ops"]["CPUExecutionProvider"].get("Gemm", 0) > 0
    fp16 = got["tiny-2x32:fp16"]
    assert fp16["loss_rel_vs_base"] <= 1e-2 and fp16["grad_cos_vs_base"] >= 0.999


def test_gemms_alone_in_fp16_with_the_cpu_standing_in(tmp_path):
    shapes = tmp_path / "s.json"
    shapes.write_text(json.dumps([{"op": "MatMul", "inputs": [[64, 32], [32, 48]], "output": [[64, 48]], "count": 3}]))
    r = subprocess.run([sys.executable, str(REPO / "bench" / "webgpu_gemms.py"), str(shapes), "--stand-in",
                        "--dtype", "float16"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["dtype"] == "float16" and out["timed"] == 1 and out["shapes"][0]["ms"] > 0
