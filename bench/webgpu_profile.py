"""Where `lorac train --target webgpu`'s step goes, and what onnxruntime's switches buy, in one
GPU call with one JSON summary (OUT/profile.json, written after each part):
(a) the profile case (Qwen3-0.6B shape 8x1024; the 40M one where that fails) under onnxruntime's
    profiler: top op types and nodes, the MatMul share, and whether the WebGPU EP put GPU kernel
    times (timestamp queries) into the trace or only the CPU's dispatch times; in the latter case
    the trace's MatMul shapes timed alone on the GPU (bench/webgpu_gemms.py), then 3 steps
    unprofiled (the case's step time);
(b) variants of the full step (training graph + LoRA+ AdamW, the loss read back) at --case (the
    40M 8x1024), each in a process of its own (the WebGPU context, which most options configure,
    is made once a process): the plugin's provider options and onnxruntime session settings
    exactly as lorac passes them (runtime/engine/ort_webgpu.DEFAULTS and SESSION, patched in the
    child), the training graph alone with the batch on the device, and the same with graph
    capture; every variant's losses and step-1 LoRA gradients against the base's;
(c) fp16 GEMMs: every MatMul of the training graph on fp16 operands (Casts in the graph; fp32
    elsewhere), where the adapter runs fp16 shaders (shader-f16);
then the faster exact options together at the profile case. Each part is a child process with a
timeout inside --budget (200 s); the variants run in the order of VARIANTS and what does not
fit is marked skipped.

Here (the dev venv; pip and apt reach their registries):
    .venv/bin/python bench/webgpu_profile.py prepare    # .devcarry/webgpu: whl/, debs/, vulkan/ (no model)
There, one call, carry [".devcarry/webgpu"] (or what bench/webgpu_check.py prepare made):
    source bench/webgpu_env.sh && python3 bench/webgpu_profile.py device $OUT/wgp
Here, no GPU (how it is tested: the CPU standing in for the adapter, tests/webgpu_stand_in.py):
    .venv/bin/python bench/webgpu_profile.py device OUT --stand-in --case tiny-2x32 --profile-case tiny-1x64
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
import webgpu_step as ws  # noqa: E402 - its runtime prepare, cases and step

MATMULS = ("MatMul", "Gemm", "FusedMatMul", "MatMulNBits")
# name -> (the plugin's options: ort_webgpu.DEFAULTS, SessionOptions attributes: ort_webgpu.SESSION,
# how it runs: the full step, the training graph alone with the batch on the device, fp16 GEMMs)
VARIANTS = {
    "base": ({}, {}, "step"),
    "validation-off": ({"validationMode": "disabled"}, {}, "step"),
    "pending-256": ({"maxNumPendingDispatches": "256"}, {}, "step"),
    "train-only": ({"enableInt64": "1"}, {}, "replay"),
    "graph-capture": ({"enableInt64": "1", "enableGraphCapture": "1"}, {}, "replay"),
    "fp16-gemm": ({}, {}, "fp16"),
    "int64": ({"enableInt64": "1"}, {}, "step"),
    "buffers-simple": ({"storageBufferCacheMode": "simple"}, {}, "step"),
    "pending-64": ({"maxNumPendingDispatches": "64"}, {}, "step"),
    "opt-extended": ({}, {"graph_optimization_level": "ORT_ENABLE_EXTENDED"}, "step"),
    "no-mem-pattern": ({}, {"enable_mem_pattern": False}, "step"),
}
EXACT = 1e-5  # a faster variant (--faster) counts as exact within this relative loss difference from the base


# -- here --------------------------------------------------------------------------------
def prepare(d: Path) -> None:
    ws.prepare_runtime(d)
    print(json.dumps({"prepared": str(d), "bytes": sum(p.stat().st_size for p in d.rglob("*") if p.is_file())}))


# -- in a child process ------------------------------------------------------------------
def fp16_gemms(model):
    """`model` (units inlined) with every MatMul on fp16 operands (a Cast per operand, shared)
    and its product cast back to float32."""
    from onnx import TensorProto, helper, inliner
    m = inliner.inline_local_functions(model)
    nodes, half = [], {}
    for n in m.graph.node:
        if n.op_type != "MatMul":
            nodes.append(n)
            continue
        for x in n.input:
            if x not in half:
                half[x] = f"{x}/fp16"
                nodes.append(helper.make_node("Cast", [x], [half[x]], to=TensorProto.FLOAT16))
        nodes.append(helper.make_node("MatMul", [half[x] for x in n.input], [f"{n.output[0]}/fp16"], name=n.name))
        nodes.append(helper.make_node("Cast", [f"{n.output[0]}/fp16"], [n.output[0]], to=TensorProto.FLOAT))
    del m.graph.node[:]
    m.graph.node.extend(nodes)
    return m


def run_steps(c, n: int, keep: dict, start: int = 0) -> tuple[list, list]:
    """n full steps (ws.full_step) after `start` -> (seconds, losses); keep: step 1's LoRA gradients."""
    times, losses = [], []
    for t in range(start + 1, start + n + 1):
        t0 = time.perf_counter()
        losses.append(ws.full_step(c, t, keep=keep if t == 1 else None))
        times.append(time.perf_counter() - t0)
    return times, losses


def run_replay(c, n: int, keep: dict) -> tuple[list, list]:
    """The training graph alone n times with the same bindings (what graph capture replays): the
    batch in device buffers, the next one copied into them before each run -> (seconds, losses)."""
    import onnxruntime as ort
    eng = c.eng
    dev = eng._values.put({"input_ids": c.batches[1], "labels": c.batches[1]})  # ws.full_step's at t = 1
    times, losses = [], []
    for r in range(n):
        if r:
            b = ort.OrtValue.ortvalue_from_numpy(c.batches[(r + 1) % 4])
            eng._values.copy([b, b], [dev["input_ids"], dev["labels"]])
        t0 = time.perf_counter()
        out = eng.step(dev, eng.lora, read_loss=True)
        times.append(time.perf_counter() - t0)
        losses.append(out.pop("loss"))
        if not r:
            keep.update(eng.host(out))
    return times, losses


def child(args) -> dict:
    if args.stand_in:
        sys.path.insert(0, str(REPO / "tests"))
        import webgpu_stand_in
        webgpu_stand_in.install()
    from lorac.runtime.engine import ort_webgpu
    if args.variants_best:
        VARIANTS["best"] = (*json.loads(args.variants_best), "step")
    options, session, mode = VARIANTS[args.variant]
    ort_webgpu.DEFAULTS, ort_webgpu.SESSION = dict(options), dict(session)
    trace = tempfile.mkdtemp(prefix="lorac-wgp-") if args.profile else None
    c = ws.setup_case(args.case, "webgpu", trace and f"{trace}/trace", rewrite=fp16_gemms if mode == "fp16" else None,
                      adamw=mode != "replay")  # a replay runs the training graph alone
    keep: dict = {}
    times, losses = (run_replay if mode == "replay" else run_steps)(c, args.warm + args.steps, keep)
    if args.save:
        np.savez(args.save, **keep)
    step_s = float(np.median(times[args.warm:] or times))
    profile = analyse(dict(zip(c.eng._sessions, c.eng.end_profiling())), args.warm) if trace else None
    profiled_ms, after_error = round(step_s * 1e3, 2), None
    try:  # the profiler ended: the same full step unprofiled (a failure here keeps the profile)
        more, losses_after = run_steps(c, args.after, {}, len(times)) if trace and args.after else ([], [])
    except Exception as e:  # noqa: BLE001
        more, losses_after, after_error = [], [], f"{type(e).__name__}: {str(e)[:300]}"
    if more:
        step_s, times, losses = float(np.median(more)), times + more, losses + losses_after
    rec = dict(case=args.case, variant=args.variant, mode=mode, options=options, session=session, B=c.B, S=c.S,
               loss_chunk=c.chunk, step_ms=round(step_s * 1e3, 2), tok_s=round(c.B * c.S / step_s),
               times_ms=[round(t * 1e3, 1) for t in times], first_step_s=round(times[0], 2),
               setup_s=round(c.setup_s, 1), losses=[round(float(x), 6) for x in losses], **ws.placement(c.eng),
               gpu_used_gb=ws.gpu_used_gb(), adapter=c.eng.adapter)
    so, ep = c.eng._sessions["train"].sess.get_session_options(), c.eng._ep_device.ep_name.lower()
    rec["session_got"] = {**{k: so.get_session_config_entry(f"ep.{ep}.{k}") for k in options},  # what reached it
                          "graph_optimization_level": str(so.graph_optimization_level).rsplit(".", 1)[-1],
                          "enable_mem_pattern": so.enable_mem_pattern}
    if mode == "fp16":  # how many MatMuls the rewrite made fp16, and where onnxruntime ran them
        plain = type(c.eng)._recipe(c.eng, "train")[0]()  # the class's recipe: not the rewritten one
        rec["fp16_matmuls"] = sum(n.op_type == "MatMul" for n in fp16_gemms(plain).graph.node)
        rec["matmuls_on"] = {ep: ops.get("MatMul", 0) for ep, ops in c.eng.placement.get("train", {}).items()}
    if trace:
        rec["profile"] = profile
        rec.update(profiled_step_ms=profiled_ms, after_error=after_error)
        shutil.rmtree(trace, ignore_errors=True)
    return rec


# -- the profile -------------------------------------------------------------------------
def _top(totals: dict, runs: int, n: int, extra: dict | None = None) -> list:
    rows = sorted(totals.items(), key=lambda kv: -kv[1])[:n]
    return [{"name": k, "ms_per_step": round(v / runs, 3), **((extra or {}).get(k, {}))} for k, v in rows]


def analyse(files: dict, warm: int, n: int = 15) -> dict:
    """onnxruntime's traces ({graph kind: trace file}) -> per graph: runs, wall and CPU dispatch ms a
    timed run (the first `warm` runs left out), the top op types and nodes by the CPU's time, and,
    where the EP wrote them (timestamp queries: events named "node&op&program"), by GPU time
    (averaged over every run: the GPU's clock does not line up with the CPU's), the MatMul shares,
    and the MatMul shapes with their counts a run (for bench/webgpu_gemms.py)."""
    out = {}
    for kind, f in files.items():
        events = json.loads(Path(f).read_text())
        runs = sorted((e for e in events if e.get("name") == "model_run"), key=lambda e: e["ts"])
        if not runs:
            continue
        timed = runs[min(warm, len(runs) - 1):]
        since = timed[0]["ts"]
        cpu_op, cpu_node, gpu_op, gpu_node, shapes, where, kernels = {}, {}, {}, {}, {}, {}, 0
        for e in events:
            a = e.get("args") or {}
            if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time") and e["ts"] >= since:
                op, node = a.get("op_name", "?"), e["name"].removesuffix("_kernel_time")
                cpu_op[op] = cpu_op.get(op, 0.0) + e["dur"] / 1e3
                cpu_node[node] = cpu_node.get(node, 0.0) + e["dur"] / 1e3
                where[node] = {"op": op, "provider": a.get("provider", "?"),
                               "inputs": [next(iter(s.values())) for s in a.get("input_type_shape", [])]}
                if op in MATMULS:
                    key = json.dumps([op, where[node]["inputs"],
                                      [next(iter(s.values())) for s in a.get("output_type_shape", [])][:1]])
                    shapes[key] = shapes.get(key, 0) + 1
            elif e.get("cat") != "Node" and "&" in e.get("name", "") and e.get("ph") == "X":  # the EP's GPU times
                node, op = e["name"].split("&")[:2]
                gpu_op[op] = gpu_op.get(op, 0.0) + e["dur"] / 1e3
                gpu_node[node] = gpu_node.get(node, 0.0) + e["dur"] / 1e3
                kernels += 1
        k = len(timed)
        share = lambda d: round(sum(v for o, v in d.items() if o in MATMULS) / max(sum(d.values()), 1e-9), 3)  # noqa: E731
        rec = {"runs": len(runs), "timed_runs": k,
               "wall_ms_per_run": round(float(np.median([r["dur"] for r in timed])) / 1e3, 2),
               "cpu_dispatch_ms_per_run": round(sum(cpu_op.values()) / k, 2),
               "kernels_per_run": round(sum(1 for e in events if e.get("cat") == "Node" and e["ts"] >= since
                                            and e.get("name", "").endswith("_kernel_time")) / k),
               "cpu_top_ops": _top(cpu_op, k, n), "cpu_top_nodes": _top(cpu_node, k, n, where),
               "cpu_matmul_share": share(cpu_op), "gpu_kernel_events": kernels,
               "matmul_shapes": [dict(zip(("op", "inputs", "output"), json.loads(s)), count=round(c / k)) for s, c in
                                 sorted(shapes.items(), key=lambda kv: -kv[1])]}
        if kernels:
            rec.update(gpu_ms_per_run=round(sum(gpu_op.values()) / len(runs), 2), gpu_top_ops=_top(gpu_op, len(runs), n),
                       gpu_top_nodes=_top(gpu_node, len(runs), n, where), gpu_matmul_share=share(gpu_op))
        out[kind] = rec
    return out


# -- there -------------------------------------------------------------------------------
def _child(out: Path, what: list[str], timeout: float, stand_in: bool, script: str = __file__) -> dict:
    """`python SCRIPT WHAT` in a process of its own -> its JSON line, or an error; its stderr
    appended to OUT/children.log, the lines about graph capture and onnxruntime's warnings and
    errors kept in the record."""
    cmd = [sys.executable, script, *what, *(["--stand-in"] if stand_in else [])]
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        got, err = ws.json_lines(r.stdout), r.stderr
    except subprocess.TimeoutExpired as e:
        got, err = [{"error": f"timeout after {timeout:.0f} s"}], e.stderr.decode() if isinstance(e.stderr, bytes) \
            else (e.stderr or "")
    with open(out / "children.log", "a") as log:
        log.write(f"\n=== {' '.join(what)}\n{err[-20000:]}")
    rec = got[-1] if got else {"error": (err.strip().splitlines() or ["?"])[-1][:400]}
    notes = [x.strip()[:300] for x in err.splitlines() if "graph capture" in x.lower() or "[E:" in x
             or ("[W:" in x and "VerifyEachNodeIsAssignedToAnEp" not in x)]
    if notes:
        rec["notes"] = list(dict.fromkeys(notes))[:6]
    rec["wall_s"] = round(time.perf_counter() - t0, 1)
    return rec


def _compare(rec: dict, base: dict, grads: Path, base_grads: Path) -> None:
    """rec's losses and step-1 gradients against the base's (in place)."""
    if "losses" not in rec or "losses" not in base:
        return
    a, b = np.array(rec["losses"]), np.array(base["losses"])
    replays = [r.get("mode") == "replay" for r in (rec, base)]
    n = min(len(a), len(b)) if replays[0] == replays[1] else 1  # a replay against full steps: step 1 alone
    rec["loss_rel_vs_base"] = float(f"{np.max(np.abs(a[:n] - b[:n]) / np.abs(b[:n])):.3g}") if n else None
    if grads.is_file() and base_grads.is_file():
        g, h = np.load(grads), np.load(base_grads)
        x = np.concatenate([g[k].ravel() for k in sorted(h.files)]).astype(np.float64)
        y = np.concatenate([h[k].ravel() for k in sorted(h.files)]).astype(np.float64)
        rec["grad_cos_vs_base"] = float(f"{x @ y / (np.linalg.norm(x) * np.linalg.norm(y)):.7f}")
        rec["grad_rel_vs_base"] = float(f"{np.max(np.abs(x - y)) / np.max(np.abs(y)):.3g}")


def device(args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "children.log").write_text("")
    deadline = time.perf_counter() + args.budget
    left = lambda: deadline - time.perf_counter()  # noqa: E731
    tmp = Path(tempfile.mkdtemp(prefix="lorac-wgp-"))
    smi = shutil.which("nvidia-smi")
    summary: dict = {"stand_in": args.stand_in, "budget_s": args.budget, "case": args.case,
                     "gpu": subprocess.run([smi, "--query-gpu=name,driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True).stdout.strip() if smi else None}
    save = lambda: (out / "profile.json").write_text(json.dumps(summary, indent=1))  # noqa: E731
    step = lambda case, variant, steps, warm, timeout, *more: _child(  # noqa: E731
        out, ["child", case, variant, "--steps", str(steps), "--warm", str(warm), *more], timeout, args.stand_in)
    # (a) the profile
    for case in dict.fromkeys([args.profile_case, args.case]):
        prof = step(case, "base", 2, 1, min(args.profile_timeout, left() - 30), "--profile", "--after", "3")
        summary["profile"] = prof
        save()
        if "error" not in prof:
            break
    separate = "error" not in prof and prof.get("case") != args.case  # the profile case is not the variants'
    train = (prof.get("profile") or {}).get("train", {})
    if train and not train.get("gpu_kernel_events") and left() > 90:
        (tmp / "shapes.json").write_text(json.dumps(train["matmul_shapes"]))
        g = _child(out, [str(tmp / "shapes.json"), "--limit", str(min(25, left() - 80))], min(50, left() - 70),
                   args.stand_in, str(HERE / "webgpu_gemms.py"))
        if "matmul_ms_per_step" in g and prof.get("step_ms"):
            g["matmul_share_of_step"] = round(g["matmul_ms_per_step"] / prof["step_ms"], 3)
        summary["matmul_alone"] = g
        save()
    # (b), (c): the variants, each in a process of its own
    keep = 50 if separate else 0  # for the profile case with the faster options at the end
    summary["variants"] = {}
    for name in [v.strip() for v in args.variants.split(",") if v.strip()]:
        if left() - keep < args.variant_min:
            summary["variants"][name] = {"skipped": "budget"}
            continue
        rec = step(args.case, name, args.steps, 2, min(60, left() - keep), "--save", str(tmp / f"{name}.npz"))
        ref = "train-only" if name == "graph-capture" else "base"  # replays: the same batches, no update
        if name != ref:
            _compare(rec, summary["variants"].get(ref, {}), tmp / f"{name}.npz", tmp / f"{ref}.npz")
            rec["compared_with"] = ref
        summary["variants"][name] = rec
        save()
    # the profile case: the base and the faster exact options together
    v = summary["variants"]
    base_ms = (v.get("base") or {}).get("step_ms")
    winners = sorted((n for n, r in v.items() if r.get("mode") == "step" and n != "base" and base_ms
                      and r.get("step_ms") and r["step_ms"] < args.faster * base_ms
                      and r.get("loss_rel_vs_base") is not None and r["loss_rel_vs_base"] <= EXACT),
                     key=lambda n: v[n]["step_ms"])
    summary["faster_exact"] = winners
    if separate and winners:
        opts, sess = {}, {}
        for n in winners:  # the fastest first: of two values for one key (pending-256, pending-64), its
            for k, x in VARIANTS[n][0].items():
                opts.setdefault(k, x)
            for k, x in VARIANTS[n][1].items():
                sess.setdefault(k, x)
        VARIANTS["best"] = (opts, sess, "step")
        summary["best_options"] = {"ep": opts, "session": sess}
        if left() > 40:  # against the profile run's unprofiled steps (its step_ms)
            best = step(args.profile_case, "best", 2, 1, left() - 5, "--variants-best", json.dumps([opts, sess]))
            _compare(best, prof, tmp / "none", tmp / "none")
            if best.get("step_ms") and prof.get("step_ms"):
                best["vs_profile_run_unprofiled"] = round(best["step_ms"] / prof["step_ms"], 3)
            summary["profile_case_best"] = best
    shutil.rmtree(tmp, ignore_errors=True)
    save()
    brief(summary)


def brief(summary: dict) -> None:
    """What the lead reads in the call's output: the profile's headline, the variants' table."""
    prof = summary.get("profile") or {}
    head = {k: prof.get(k) for k in ("case", "step_ms", "profiled_step_ms", "first_step_s", "setup_s", "error")}
    for kind, r in (prof.get("profile") or {}).items():
        head[kind] = {k: r.get(k) for k in ("wall_ms_per_run", "cpu_dispatch_ms_per_run", "kernels_per_run",
                                            "gpu_kernel_events", "gpu_ms_per_run", "cpu_matmul_share",
                                            "gpu_matmul_share")}
        head[kind]["top"] = [(x["name"], x["ms_per_step"]) for x in (r.get("gpu_top_ops") or r["cpu_top_ops"])[:8]]
        head[kind]["top_nodes"] = [(x["name"][-60:], x.get("op"), x["ms_per_step"], x.get("inputs"))
                                   for x in (r.get("gpu_top_nodes") or r["cpu_top_nodes"])[:5]]
    runs = (prof.get("profile") or {}).values()
    head["cpu_dispatch_ms_per_step"] = round(sum(r.get("cpu_dispatch_ms_per_run", 0) for r in runs), 1)  # all graphs
    print(json.dumps({"profile": head, "placement": prof.get("placement"), "off_webgpu": prof.get("off_main")}))
    alone = summary.get("matmul_alone")
    if alone:
        print(json.dumps({"matmul_alone": {k: v for k, v in alone.items() if k != "shapes"}}))
    print(json.dumps({k: summary.get(k) for k in ("faster_exact", "best_options", "profile_case_best")}))
    print("\n| variant | step ms | vs base | loss rel vs base | grad cos | placement (train) | notes |")
    print("|---|---|---|---|---|---|---|")
    base = (summary.get("variants", {}).get("base") or {}).get("step_ms")
    for name, r in summary.get("variants", {}).items():
        ms = r.get("step_ms")
        print(f"| {name} | {ms or r.get('error') or r.get('skipped')} | {round(ms / base, 3) if ms and base else '-'} | "
              f"{r.get('loss_rel_vs_base', '-')} | {r.get('grad_cos_vs_base', '-')} | "
              f"{(r.get('placement') or {}).get('train', '-')} | {'; '.join(r.get('notes', []))[:120]} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sp = ap.add_subparsers(dest="mode", required=True)
    sp.add_parser("prepare").add_argument("dir", nargs="?", default=str(ws.DIR))
    p = sp.add_parser("device")
    p.add_argument("out")
    p.add_argument("--case", default="40m-8x1024", help="the variants' case")
    p.add_argument("--profile-case", default="q06-8x1024")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--steps", type=int, default=5, help="timed full steps a variant (after 2 warm ones)")
    p.add_argument("--budget", type=float, default=200.0, help="seconds for everything; what does not fit is skipped")
    p.add_argument("--profile-timeout", type=float, default=100.0)
    p.add_argument("--variant-min", type=float, default=15.0, help="seconds a variant needs at least")
    p.add_argument("--faster", type=float, default=0.97, help="a variant is faster below this fraction of the base")
    p.add_argument("--stand-in", action="store_true", help="the CPU standing in for the WebGPU adapter (no GPU)")
    p = sp.add_parser("child")
    p.add_argument("case", choices=sorted(ws.CASES))
    p.add_argument("variant")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warm", type=int, default=2)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--after", type=int, default=0, help="with --profile: steps timed after the profiler ended")
    p.add_argument("--save")
    p.add_argument("--variants-best")
    p.add_argument("--stand-in", action="store_true")
    args = ap.parse_args()
    if args.mode == "prepare":
        prepare(Path(args.dir))
    elif args.mode == "device":
        device(args)
    else:
        print(json.dumps(child(args)), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
