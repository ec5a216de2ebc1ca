"""Which of onnxruntime's WebGPU kernels are inexact, and what that does to training
(bench/webgpu_check.py's `ops` and `emulate`):
- ops_probe: single ops on random inputs on the WebGPU EP and the CPU provider against float64;
- emulate: the exactness run on this CPU's onnxruntime provider with exp and log as inexact as
  Vulkan (so WebGPU) allows, patched in as lorac emits its graphs.
"""
from __future__ import annotations

import json
import math
import sys
import tempfile
from pathlib import Path

import numpy as np

import webgpu_step as ws

REPO = Path(__file__).resolve().parent.parent
BETAS = (0.9, 0.999, 0.99999)  # AdamW's beta1, beta2, and a slower one


def ops_probe(stand_in: bool) -> dict:
    """(e) single ops on random inputs: WebGPU and the CPU provider vs float64 (max relative
    error; Log's also absolute, where Vulkan specifies it)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper
    from lorac.runtime.engine import ort_webgpu
    if stand_in:
        sys.path.insert(0, str(REPO / "tests"))
        import webgpu_stand_in
        webgpu_stand_in.install()
    dev, _ = ort_webgpu.open_device(ort)

    def run(model: bytes, feeds: dict, side: str) -> list:
        so = ort.SessionOptions()
        if side == "webgpu":
            so.add_provider_for_devices([dev], {})
            return ort.InferenceSession(model, so).run(None, feeds)
        return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"]).run(None, feeds)
    rng = np.random.default_rng(0)
    u = lambda lo, hi, *s: rng.uniform(lo, hi, s).astype(np.float32)  # noqa: E731
    n = 1 << 16
    # name: (op, inputs, float64 result, the scale an error is relative to): the value itself for
    # elementwise ops (Sigmoid: where >= 1e-6), sum |x| for a sum and |A| @ |B| for a product (so
    # cancellation does not count), |log x| >= 1e-3 for log near 1 (its absolute error as well)
    cases = {"Exp[-30,0]": ("Exp", [u(-30, 0, n)], np.exp, None), "Exp[-1,1]": ("Exp", [u(-1, 1, n)], np.exp, None),
             "Log[0.5,2]": ("Log", [u(0.5, 2, n)], np.log, None), "Log[0.99,1]": ("Log", [u(0.99, 1, n)], np.log, None),
             "Sqrt": ("Sqrt", [u(1e-6, 10, n)], np.sqrt, None),
             "Reciprocal": ("Reciprocal", [u(0.1, 10, n)], lambda x: 1 / x, None),
             "Div": ("Div", [u(-10, 10, n), u(0.1, 10, n)], np.divide, None),
             "Sigmoid": ("Sigmoid", [u(-20, 20, n)], lambda x: 1 / (1 + np.exp(-x)), None),
             "Softmax": ("Softmax", [u(-20, 20, 64, 1024)], lambda x: np.exp(x - x.max(-1, keepdims=True)) /
                         np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True), None),
             "ReduceSum": ("ReduceSum", [u(-1, 1, 64, 4096)], lambda x: x.sum(-1, keepdims=True),
                           lambda x: np.abs(x).sum(-1, keepdims=True)),
             "MatMul": ("MatMul", [u(-1, 1, 256, 1024), u(-1, 1, 1024, 256)], np.matmul,
                        lambda a, b: np.abs(a) @ np.abs(b))}
    out = {}
    for name, (op, xs, f, scale_of) in cases.items():
        ins = [f"x{i}" for i in range(len(xs))]
        node = helper.make_node(op, ins, ["y"], **({"axis": -1} if op == "Softmax" else {}))
        if op == "ReduceSum":
            node = helper.make_node(op, ["x0", "axes"], ["y"], keepdims=1)
        g = helper.make_graph([node], "op", [helper.make_tensor_value_info(n, TensorProto.FLOAT, x.shape)
                                             for n, x in zip(ins, xs)], [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [helper.make_tensor("axes", TensorProto.INT64, [1], [-1])] if op == "ReduceSum" else [])
        model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=9).SerializeToString()
        x64 = [x.astype(np.float64) for x in xs]
        ref = f(*x64)
        scale = np.abs(ref) if scale_of is None else scale_of(*x64)
        keep = scale >= {"Log": 1e-3, "Sigmoid": 1e-6}.get(op, 1e-30)
        row = {}
        for side in ("webgpu", "cpu_ep"):
            err = np.abs(run(model, dict(zip(ins, xs)), side)[0].astype(np.float64) - ref)
            row[side] = float(f"{np.max(err[keep] / scale[keep]):.3g}")
            if op == "Log":
                row[f"{side}_abs"] = float(f"{err.max():.3g}")
        out[name] = row
    # the optimizer's bias corrections 1 - b^t, t = 1..200000: the graph's form and the previous one
    from lorac.graphs.builder import GraphBuilder
    from lorac.graphs.optimizer import _one_minus_pow
    t = np.arange(1, 200_001, dtype=np.float32)
    for name, form in (("BiasCorrection[now]", _one_minus_pow), ("BiasCorrection[kahan]", kahan_form)):
        g = GraphBuilder("bc")
        ti = g.input("t", [len(t)])
        for i, b in enumerate(BETAS):
            g.output(form(g, b, ti), f"bc{i}")
        model = g.finish("1 - b^t", data_prop=False).SerializeToString()
        out[name] = {side: float(f"{max(np.max(np.abs(y - r) / r) for y, r in zip(run(model, {'t': t}, side), refs)):.3g}")
                     for side in ("webgpu", "cpu_ep") for refs in [[-np.expm1(t * np.float64(math.log(b))) for b in BETAS]]}
    return out


def kahan_form(g, b: float, t):
    """The optimizer's previous 1 - b^t (graphs/optimizer.py has why it was replaced): Kahan's
    expm1, (u - 1) q / log(u) with u = exp(q), q = t ln b; plain u - 1 once q < -0.5."""
    q = g.op("Mul", t, g.f(math.log(b)))
    u = g.op("Exp", q)
    um1 = g.op("Sub", u, g.f(1.0))
    direct = g.op("Or", g.op("Less", q, g.f(-0.5)), g.op("Equal", u, g.f(1.0)))
    ratio = g.op("Div", g.op("Mul", um1, q), g.op("Log", g.op("Where", direct, g.f(0.5), u)))
    return g.op("Neg", g.op("Where", g.op("Equal", u, g.f(1.0)), q, g.op("Where", direct, um1, ratio)))


def emulate(d: Path, kahan: bool) -> None:
    """The exactness run on this CPU's onnxruntime provider with a GPU's inexact math: every Exp
    off by (3 + 2|x|) ulp and every Log by 2^-21, the bounds Vulkan (so WebGPU) allows, patched
    in as the graphs are emitted; kahan: the optimizer's bias correction in its previous form,
    (u - 1) q / log(u). Prints the 20 steps' largest relative difference from ref/tvm."""
    from lorac.graphs import builder, optimizer
    op = builder.GraphBuilder.op

    def inexact(g, kind, *inputs, **kw):
        y = op(g, kind, *inputs, **kw)
        if kind == "Exp":
            ulps = op(g, "Add", op(g, "Mul", op(g, "Abs", inputs[0]), g.f(2.0 ** -22)), g.f(1 + 3 * 2.0 ** -23))
            y = op(g, "Mul", y, ulps)
        elif kind == "Log":
            y = op(g, "Add", y, g.f(2.0 ** -21))
        return y

    builder.GraphBuilder.op = inexact
    if kahan:
        optimizer._one_minus_pow = kahan_form
    from lorac.runtime.cli import main as lorac_main
    from webgpu_check import common
    with tempfile.TemporaryDirectory() as tmp:
        if lorac_main([*common(d), "--out", tmp, "--backend", "ort"]):
            sys.exit(1)
        got = ws.curve(Path(tmp))
    print(json.dumps({"emulated": "Exp (3 + 2|x|) ulp, Log 2^-21", "bias_correction": "kahan" if kahan else "series",
                      "max_rel_vs_tvm": ws.compare("", got, ws.curve(d / "ref" / "tvm"))["max_rel_diff"]}))
