"""Where the WebGPU step's time goes, by difference: the full step (training graph, LoRA+ AdamW,
the loss read back) of graph variants, each in a process of its own, in one GPU call.

onnxruntime's WebGPU plugin writes no GPU kernel times into its profile (bench/webgpu_profile.py),
so this measures by taking parts away: the Qwen3-0.6B shape with 28, 2 and 1 layers (a layer's
cost and what is not layers: embedding, LM head and loss, the update), the same with attention
replaced by an identity (what attention costs), and candidates against the current graph with
their losses and step-1 gradients compared: leaner attention bodies (graphs/ops/attention.py), an
fp16 graph, onnxruntime's GEMM fusions off, larger loss chunks (docs/BENCHMARKS.md has the results).

Here (the dev venv), and the CPU standing in for the adapter (no GPU; tests the plumbing):
    .venv/bin/python bench/webgpu_step.py prepare                      # .devcarry/webgpu
    .venv/bin/python bench/webgpu_parts.py device OUT --stand-in --runs tiny-2x32:base,tiny-2x32:lean
There, carry [".devcarry/webgpu"]:
    source bench/webgpu_env.sh && python3 bench/webgpu_parts.py device $OUT/parts
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
import webgpu_profile as wp  # noqa: E402 - its child processes, steps and comparison with the base
import webgpu_step as ws  # noqa: E402 - cases, setup, the full step

for n in (1, 2):  # the 0.6B shape's layer count cut, for a layer's cost by difference
    ws.CASES[f"q06l{n}-8x1024"] = ({**ws.QWEN3_06B, "num_hidden_layers": n}, None, 8, 1024)
DEFAULT_RUNS = ("q06-8x1024:base", "q06-8x1024:no-attention", "q06-8x1024:lean", "q06l2-8x1024:base",
                "q06l1-8x1024:base", "q06l2-8x1024:no-attention")


# -- the variants (patched into graphs/ops/attention.py in the child, before the graphs are built)
def _no_attention(att) -> None:
    """Attention as identities: o = q, lse = 0, dq = do, dk = k, dv = v (the step without it)."""
    def forward(fb, q, k, v, scale, dims, mask, positions=None):
        B, K, G, S, Dh = dims
        lse = fb.op("Mul", fb.op("ReduceMax", fb.transpose(q, 0, 2, 1, 3), fb.ints(-1), keepdims=1), fb.f(0.0))
        return fb.op("Identity", q), lse

    def backward(fb, q, k, v, o, do, lse, scale, dims, mask, positions=None):
        return fb.op("Identity", do), fb.op("Identity", k), fb.op("Identity", v)
    att._forward_body, att._backward_body = forward, backward


def _lean(att) -> None:
    """Candidate bodies with fewer passes over the [B, H, S, S] scores: the scale folded into q
    (a [B, S, H, Dh] product) in both units and dq scaled after its matmul; the forward's lse
    from the softmax itself (p at the row maximum is 1 / sum exp(s - m), so lse = m - log max p)
    instead of a second exp and sum."""
    def forward(fb, q, k, v, scale, dims, mask, positions=None):
        B, K, G, S, Dh = dims
        s, _ = att._masked_scores(fb, fb.op("Mul", q, scale), k, None, dims, mask, positions)
        p = fb.op("Softmax", s, axis=-1)
        o = att._ungrouped(fb, fb.matmul(fb.reshape(p, B, K, G * S, S), fb.transpose(v, 0, 2, 1, 3)), dims, K * G)
        m = fb.op("ReduceMax", s, fb.ints(-1), keepdims=1)
        lse = fb.op("Sub", m, fb.op("Log", fb.op("ReduceMax", p, fb.ints(-1), keepdims=1)))
        return o, fb.reshape(lse, B, K * G, S, 1)

    def backward(fb, q, k, v, o, do, lse, scale, dims, mask, positions=None):
        B, K, G, S, Dh = dims
        qs = fb.op("Mul", q, scale)
        s, t = att._masked_scores(fb, qs, k, None, dims, mask, positions)
        p = fb.op("Exp", fb.op("Sub", s, fb.reshape(lse, B, K, G, S, 1)))
        p4 = fb.reshape(p, B, K, G * S, S)
        dog = att._grouped(fb, do, dims)
        dv = fb.matmul(fb.transpose(p4, 0, 1, 3, 2), dog)
        dp = fb.reshape(fb.matmul(dog, fb.transpose(v, 0, 2, 3, 1)), B, K, G, S, S)
        rowsum = fb.reshape(fb.transpose(fb.reduce_sum(fb.op("Mul", do, o), -1), 0, 2, 1, 3), B, K, G, S, 1)
        ds = fb.op("Mul", p, fb.op("Sub", dp, rowsum))
        if t is not None:
            ds = fb.op("Mul", ds, fb.op("Sub", fb.f(1.0), fb.op("Mul", t, t)))
        ds = fb.reshape(ds, B, K, G * S, S)
        dq = fb.op("Mul", fb.matmul(ds, fb.transpose(k, 0, 2, 1, 3)), scale)
        dk = fb.matmul(fb.transpose(ds, 0, 1, 3, 2), att._grouped(fb, qs, dims))
        return att._ungrouped(fb, dq, dims, K * G), att._ungrouped(fb, dk, dims, K), att._ungrouped(fb, dv, dims, K)
    att._forward_body, att._backward_body = forward, backward


# fp16: onnxruntime's float16 converter over the inlined training graph, these kept in fp32 (the
# converter casts around them): reductions, exp/log/sqrt/div, the loss (every `head/` node but its
# GEMMs) and the gradient outputs; a static gradient scale (B*S, i.e. the sum of the token losses
# instead of their mean) so the backward's values stay inside fp16's range, taken out at the outputs
FP32_OPS = ["Softmax", "ReduceMax", "ReduceSum", "ReduceMean", "Exp", "Log", "Sqrt", "Reciprocal", "Pow", "Div",
            "Range", "Max", "Min", "Cast", "GatherElements", "Gather", "Concat", "Slice"]


def fp16_graph(model, scale: float):
    """`model` (the training graph) with its activations and GEMMs in fp16 (FP32_OPS, the loss but its
    GEMMs, and the graph's inputs and outputs fp32), the token weights times `scale` and every
    output divided by it."""
    from onnx import helper, inliner
    from onnxruntime.transformers import float16
    m = inliner.inline_local_functions(model)
    weight = next(n for n in m.graph.node if n.op_type == "Div" and n.name.startswith("head/"))
    scaled = weight.output[0]
    weight.output[0] = scaled + "/unscaled"
    nodes = list(m.graph.node)
    at = nodes.index(weight) + 1
    nodes.insert(at, helper.make_node("Mul", [weight.output[0], "grad_scale"], [scaled], name="head/grad_scale"))
    outs = {o.name: o.name + "/scaled" for o in m.graph.output}  # every output (loss, gradients) divided by it
    for n in nodes:
        n.output[:] = [outs.get(x, x) for x in n.output]
        n.input[:] = [outs.get(x, x) for x in n.input]
    nodes += [helper.make_node("Mul", [x, "grad_unscale"], [o], name=f"out/unscale/{o}") for o, x in outs.items()]
    del m.graph.node[:]
    m.graph.node.extend(nodes)
    m.graph.initializer.extend([helper.make_tensor("grad_scale", 1, [], [scale]),
                                helper.make_tensor("grad_unscale", 1, [], [1.0 / scale])])
    keep = [n.name for n in m.graph.node if (n.name.startswith(("head/", "out/", "fwd/"))
                                            and n.op_type not in ("MatMul", "Gemm"))]
    del m.graph.value_info[:]  # the converter infers the types anew
    return float16.convert_float_to_float16(m, keep_io_types=True, op_block_list=FP32_OPS, node_block_list=keep)


def _unfused(names):
    """onnxruntime's graph optimizers `names` off in every session (their fusions of a Transpose or
    an Add into a GEMM: FusedMatMul, Gemm with transA/transB or C)."""
    def patch(att) -> None:
        import onnxruntime as ort
        made = ort.InferenceSession

        def session(*a, **kw):
            return made(*a, **{**kw, "disabled_optimizers": list(names)})
        ort.InferenceSession = session
    return patch


def _chunk(tokens: int):
    """The loss in `tokens`-token chunks (the default: a chunk's fp32 logits within 512 MiB)."""
    def patch(att) -> None:
        from lorac.graphs.ops import loss
        loss.auto_chunk = lambda vocab, n, budget=0: tokens
    return patch


PATCHES = {"base": None, "no-attention": _no_attention, "lean": _lean, "fp16": None,  # fp16: a rewrite (child)
           "chunk16": _chunk(16), "chunk1024": _chunk(1024), "chunk2048": _chunk(2048),
           "unfused-transpose": _unfused(["MatmulTransposeFusion"]),
           "unfused": _unfused(["MatmulTransposeFusion", "MatMulAddFusion", "GemmTransposeFusion"])}


def child(args) -> dict:
    if args.stand_in:
        sys.path.insert(0, str(REPO / "tests"))
        import webgpu_stand_in
        webgpu_stand_in.install()
    from lorac.graphs.ops import attention
    if PATCHES[args.variant]:
        PATCHES[args.variant](attention)
    B, S = ws.CASES[args.case][2:]
    fp16 = args.variant == "fp16"
    c = ws.setup_case(args.case, "webgpu", rewrite=(lambda m: fp16_graph(m, float(B * S))) if fp16 else None)
    keep: dict = {}
    times, losses = wp.run_steps(c, args.warm + args.steps, keep)
    if args.save:
        np.savez(args.save, **keep)
    step_s = float(np.median(times[args.warm:]))
    return dict(case=args.case, variant=args.variant, step_ms=round(step_s * 1e3, 2),
                times_ms=[round(t * 1e3, 1) for t in times], losses=[round(float(x), 6) for x in losses],
                setup_s=round(c.setup_s, 1), gpu_used_gb=ws.gpu_used_gb(), **ws.placement(c.eng),
                gemm_ops={ep: {op: n for op, n in ops.items() if op in (*wp.MATMULS, "Transpose")}
                          for ep, ops in c.eng.placement.get("train", {}).items()})


def device(args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "children.log").write_text("")
    tmp = Path(tempfile.mkdtemp(prefix="lorac-wparts-"))
    deadline = time.perf_counter() + args.budget
    recs: dict = {}
    for run in [r.strip() for r in args.runs.split(",") if r.strip()]:
        case, variant = run.split(":")
        left = deadline - time.perf_counter()
        if left < 20:
            recs[run] = {"skipped": "budget"}
            continue
        rec = wp._child(out, ["child", case, variant, "--steps", str(args.steps), "--warm", "2",
                              "--save", str(tmp / f"{case}-{variant}.npz")], min(args.timeout, left), args.stand_in,
                        __file__)
        if variant not in ("base", "no-attention"):  # a candidate: exact against the base?
            wp._compare(rec, recs.get(f"{case}:base", {}), tmp / f"{case}-{variant}.npz", tmp / f"{case}-base.npz")
        recs[run] = rec
        print(json.dumps({run: rec}), flush=True)
        (out / "parts.json").write_text(json.dumps(recs, indent=1))
    if args.peer and deadline - time.perf_counter() > 30:  # torch eager + PEFT on the same GPU (bf16)
        got = ws.sub([sys.executable, str(HERE / "peer_lora_gpu.py"), "qwen3-0.6b", "8x1024", "eager"],
                     int(deadline - time.perf_counter()))
        recs["eager"] = got[0] if got else {"error": "no output"}
        print(json.dumps({"eager": recs["eager"]}), flush=True)
    shutil.rmtree(tmp, ignore_errors=True)
    ms = lambda run: (recs.get(run) or {}).get("step_ms")  # noqa: E731
    print("\n| case:variant | step ms | loss rel vs base | grad cos vs base |")
    print("|---|---|---|---|")
    for run, r in recs.items():
        print(f"| {run} | {r.get('step_ms') or r.get('error') or r.get('skipped')} | "
              f"{r.get('loss_rel_vs_base', '-')} | {r.get('grad_cos_vs_base', '-')} |")
    full, l1, l2 = ms("q06-8x1024:base"), ms("q06l1-8x1024:base"), ms("q06l2-8x1024:base")
    if ms("eager"):  # the full 0.6B steps (not the cut or attention-less ones) over eager's
        full_runs = [run for run in recs if run.startswith("q06-") and "no-attention" not in run and ms(run)]
        print(json.dumps({"over_eager": {run: round(ms(run) / ms("eager"), 2) for run in full_runs}}))
    if l1 and l2:
        layer = l2 - l1
        derived = {"layer_ms": round(layer, 2), "not_layers_ms": round(l1 - layer, 2)}
        if full:
            derived["layers_share_of_step"] = round(ws.QWEN3_06B["num_hidden_layers"] * layer / full, 3)
        a2 = ms("q06l2-8x1024:no-attention")
        if a2:
            derived["attention_ms_a_layer"] = round((l2 - a2) / 2, 2)
        if full and ms("q06-8x1024:no-attention"):
            derived["attention_share_of_step"] = round((full - ms("q06-8x1024:no-attention")) / full, 3)
        print(json.dumps({"derived": derived}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sp = ap.add_subparsers(dest="mode", required=True)
    p = sp.add_parser("device")
    p.add_argument("out")
    p.add_argument("--runs", default=",".join(DEFAULT_RUNS), help="CASE:VARIANT,... (cases: webgpu_step's and "
                   "q06l1/q06l2-8x1024; variants: " + ", ".join(PATCHES) + ")")
    p.add_argument("--steps", type=int, default=3, help="timed full steps a run (after 2 warm ones)")
    p.add_argument("--timeout", type=float, default=150.0, help="seconds a run")
    p.add_argument("--budget", type=float, default=480.0, help="seconds for everything")
    p.add_argument("--peer", action="store_true", help="torch eager + PEFT at the 0.6B shape (bench/peer_lora_gpu.py)")
    p.add_argument("--stand-in", action="store_true", help="the CPU standing in for the WebGPU adapter (no GPU)")
    p = sp.add_parser("child")
    p.add_argument("case", choices=sorted(ws.CASES))
    p.add_argument("variant", choices=sorted(PATCHES))
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warm", type=int, default=2)
    p.add_argument("--save")
    p.add_argument("--stand-in", action="store_true")
    args = ap.parse_args()
    if args.mode == "child":
        print(json.dumps(child(args)), flush=True)
    else:
        device(args)


if __name__ == "__main__":
    main()
