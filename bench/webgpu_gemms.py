"""The MatMul-like nodes of an onnxruntime profile timed alone on the WebGPU device, for
bench/webgpu_profile.py where the WebGPU EP wrote no GPU kernel times into the trace:

    python3 bench/webgpu_gemms.py SHAPES.json [--limit SECONDS] [--stand-in]

SHAPES.json: webgpu_profile.analyse's matmul_shapes ([{op, inputs, output, count}], count a
step). Prints one JSON line: ms a run per shape (fp32, inputs and output on the device; the
most flops a step first, until --limit), the TFLOP/s it reached, and the sum over a step's
counts with the share of the step's MatMul flops it covers.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def _gemm_node(sig: dict, elem=None):
    """A one-node graph of a profile's MatMul-like node from its shapes (Gemm's and FusedMatMul's
    transposes: the ones that give its output shape) -> (graph, input shapes, output shape,
    flops), or None where no reading fits."""
    from onnx import TensorProto, helper
    op, ins, out = sig["op"], sig["inputs"], (sig.get("output") or [None])[0]
    if op not in ("MatMul", "Gemm", "FusedMatMul") or out is None or len(ins) < 2 or min(len(ins[0]), len(ins[1])) < 2:
        return None
    a, b = ins[0], ins[1]
    for ta, tb in ((0, 0), (0, 1), (1, 0), (1, 1)) if op != "MatMul" else ((0, 0),):
        m, k = (a[-1], a[-2]) if ta else (a[-2], a[-1])
        k2, n = (b[-1], b[-2]) if tb else (b[-2], b[-1])
        if k == k2 and [m, n] == list(out[-2:]):
            break
    else:
        return None
    names = ["a", "b", "c"][:len(ins)]
    attrs = {} if op == "MatMul" else {"transA": ta, "transB": tb}
    node = helper.make_node(op, names, ["y"], domain="com.microsoft" if op == "FusedMatMul" else "", **attrs)
    elem = TensorProto.FLOAT if elem is None else elem
    g = helper.make_graph([node], "mm", [helper.make_tensor_value_info(x, elem, sh) for x, sh in zip(names, ins)],
                          [helper.make_tensor_value_info("y", elem, out)])
    return g, dict(zip(names, ins)), out, 2.0 * float(np.prod(out)) * k


def gemms(args) -> dict:
    """The MatMul-like shapes of a profile (args.shapes: analyse's matmul_shapes), the most flops a
    step first, each timed alone on the device until args.limit: fp32, inputs and output on the
    device; one run and a read of a one-element tensor (the queue drained) for an estimate, then
    enough runs for ~30 ms (2 to 20) and one read -> ms a run per shape (and the provider that ran
    it), the sum over a step's counts, and the share of the step's MatMul flops timed. --dtype
    float16: fp16 operands and product."""
    if args.stand_in:
        sys.path.insert(0, str(REPO / "tests"))
        import webgpu_stand_in
        webgpu_stand_in.install()
    import onnxruntime as ort
    from onnx import helper
    from lorac.runtime.engine import ort as eo
    from lorac.runtime.engine import ort_webgpu
    dev, _ = ort_webgpu.open_device(ort, ort_webgpu.options())
    vals, rng = eo.DeviceValues(ort, dev), np.random.default_rng(0)
    sync = vals.put({"s": np.zeros(1, np.float32)})["s"]
    dt = np.dtype(args.dtype)
    elem = helper.np_dtype_to_tensor_dtype(dt)
    sigs = [(sig, _gemm_node(sig, elem)) for sig in json.loads(Path(args.shapes).read_text())]
    sigs.sort(key=lambda x: -(x[1][3] * x[0]["count"] if x[1] else 0))
    all_flop = sum(b[3] * sig["count"] for sig, b in sigs if b)
    rows, total, timed_flop, t_end = [], 0.0, 0.0, time.perf_counter() + args.limit
    for sig, built in sigs:
        if built is None or time.perf_counter() > t_end:
            rows.append({**sig, "skipped": "time" if built else "no reading of its shapes"})
            continue
        g, shapes, out_shape, flop = built
        so = ort.SessionOptions()
        so.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
        so.add_provider_for_devices([dev], ort_webgpu.options())
        model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)],
                                  ir_version=9)
        s = eo.Session(ort, model, so, None)
        ins = vals.put({x: rng.standard_normal(sh, np.float32).astype(dt) for x, sh in shapes.items()})
        outs = {"y": vals.empty(out_shape, dt)}
        s.run(ins, outs)  # the shader built
        vals.read([sync])
        t0 = time.perf_counter()
        s.run(ins, outs)
        vals.read([sync])
        reps = int(min(20, max(2, 0.03 / max(time.perf_counter() - t0, 1e-6))))
        t0 = time.perf_counter()
        for _ in range(reps):
            s.run(ins, outs)
        vals.read([sync])
        ms = (time.perf_counter() - t0) * 1e3 / reps
        rows.append({**sig, "ms": round(ms, 3), "tflops": round(flop / ms / 1e9, 2), "reps": reps,
                     "on": sorted(s.placement())})
        total += ms * sig["count"]
        timed_flop += flop * sig["count"]
    return {"dtype": dt.name, "matmul_ms_per_step": round(total, 1), "timed": sum("ms" in r for r in rows),
            "flop_share_timed": round(timed_flop / all_flop, 3) if all_flop else None,
            "tflops_overall": round(timed_flop / total / 1e9, 2) if total else None, "shapes": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("shapes")
    ap.add_argument("--limit", type=float, default=25.0, help="seconds for the shapes; the rest are skipped")
    ap.add_argument("--dtype", choices=("float32", "float16"), default="float32",
                    help="the operands' and product's type (float16: the adapter's shader-f16)")
    ap.add_argument("--stand-in", action="store_true", help="the CPU standing in for the WebGPU adapter (no GPU)")
    print(json.dumps(gemms(ap.parse_args())), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
