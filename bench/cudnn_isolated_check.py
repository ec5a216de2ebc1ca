"""cuDNN's packed (isolated) attention on the GPU: lorac's runtime path against fp32 torch
attention run per document, and its time against the plain causal cuDNN call.

On the H200 machine (python 3.12, torch and the image's nvidia-cudnn-cu13; cuDNN's Python
frontend from .devcarry/rt.tar.xz; no compiled artifact), from the repo root:

    source bench/h200_env.sh && python3 bench/cudnn_isolated_check.py --json $OUT/cudnn_isolated.json

Here, on the CPU, the same stages run against an emulator of the frontend (tests/_cudnn_emulator.py)
at a small shape, which checks this script, not cuDNN:

    python bench/cudnn_isolated_check.py --emulate

It exercises lorac's runtime directly (runtime/devices/cuda/attention.py, documents.py and
sdpa.py's Plan, on torch's device buffers), not a compiled step. Stages, each reported on its own (one failing does not
stop the others; the JSON is rewritten after each):
  env       python, torch, CUDA, GPU, cuDNN frontend and backend versions, libcudnn's path
  data      B=8 rows of S=1024 tokens, each packing 4..40 documents of random lengths
            (length-1 documents among them, first and last in a row too), GQA 16/8 heads, Dh 128
  exact     packed forward + backward plans built for the batch's document count: O, LSE, dQ, dK,
            dV (bf16) against fp32 attention per document alone (torch, TF32 off): max |err|,
            max |ref|, cosine (ok: cosine >= 0.999 and no NaN); nothing written past the tokens
  padded    the same with B x 40 sequences, the unused ones empty (length 0, starting at the
            end): what the runtime builds (reserve_documents) - cuDNN and zero-length sequences
  replay    forward + backward captured in a CUDA graph, then replayed twice after the document
            buffers and the inputs were refilled with other batches (what lorac's captured step does)
  time      the packed calls (exact and padded) against the plain causal cuDNN call on the same
            tensors (median of CUDA-event timings), and the host time of one documents fill
  variants  when exact or padded failed (or --variants): empty sequences starting at 0; dummy
            1-token sequences over a scratch token; stats in the padded (non-ragged) layout,
            timed against the ragged stats
  speed     with --variants or --speed: what makes the packed call faster (plans as long as
            the longest document, length groups, cuDNN's options and engines, documents
            masked by a bias on plain rows), each checked and timed against the plain call,
            on this batch and on one of short documents (bench/cudnn_isolated_speed.py)
  tvm       when TVM's runtime imports (h200_env.sh): prepare() + feeder() + the registered
            global functions on DLPack views of the same tensors (the path a compiled step
            calls), for builds masking documents as ragged sequences and by a bias
Exit status 0 when exact, padded and replay passed. Helpers: bench/cudnn_isolated_common.py
(buffers, batches, the reference, comparisons), bench/cudnn_isolated_variants.py,
bench/cudnn_isolated_speed.py.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import sys
import time
import traceback
from pathlib import Path

import numpy as np

import cudnn_isolated_common as C
from cudnn_isolated_common import (REPO, Outputs, describe, empty, ensure_workspace, libcudnn, make_batch, plan,
                                   reference, runtime_modules, set_stream, show, sync, timed)

REPORT: dict = {"stages": {}}
ARGS = None
DEV = "cuda"


def save() -> None:
    if ARGS and ARGS.json:
        Path(ARGS.json).write_text(json.dumps(REPORT, indent=1, default=str))


def stage(name: str, fn, *args):
    """Run one stage: its result dict (with "ok") or the error, printed and kept in REPORT."""
    print(f"\n== {name}", flush=True)
    t0 = time.time()
    try:
        out = fn(*args) or {}
    except Exception as e:  # noqa: BLE001 - every stage reports on its own
        print(traceback.format_exc()[-4000:], flush=True)
        out = {"ok": False, "error": f"{type(e).__name__}: {str(e).strip()[:3000]}"}
    out.setdefault("ok", True)
    out["seconds"] = round(time.time() - t0, 2)
    REPORT["stages"][name] = out
    save()
    print(f"-- {name}: {'ok' if out['ok'] else 'FAILED'} ({out['seconds']} s)"
          + (f": {out['error'][:300]}" if "error" in out else ""), flush=True)
    return out


# -- the stages ----------------------------------------------------------------------------
def st_env(ctx):
    import torch
    info = {"python": sys.version.split()[0], "torch": torch.__version__, "torch_cuda": torch.version.cuda,
            "device": DEV, "emulate": ARGS.emulate}
    if DEV == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
        info["capability"] = list(torch.cuda.get_device_capability(0))
        info["torch_cudnn"] = torch.backends.cudnn.version()
    if ARGS.emulate:
        sys.path.insert(0, str(REPO / "tests"))
        import _cudnn_emulator
        sys.modules["cudnn"] = _cudnn_emulator
    else:
        so = libcudnn()
        info["libcudnn"] = so
        if so:
            ctypes.CDLL(so, mode=ctypes.RTLD_GLOBAL)
    import cudnn
    info["cudnn_frontend"] = getattr(cudnn, "__version__", "?")
    info["cudnn_frontend_file"] = getattr(cudnn, "__file__", "?")
    info["cudnn_backend"] = cudnn.backend_version_string()
    att, documents, sdpa = runtime_modules()
    info["lorac_attention"] = att.__file__
    ctx["documents"], ctx["sdpa"] = documents, sdpa
    att._init()
    set_stream(att)
    ctx["att"] = att
    for k, v in info.items():
        print(f"  {k}: {v}")
    return info


def st_data(ctx):
    import torch
    torch.backends.cuda.matmul.allow_tf32 = False  # an fp32 reference
    torch.backends.cudnn.allow_tf32 = False
    a = ARGS
    first = [(a.docs_lo, 1), (a.docs_hi, 3), (max(a.docs_lo, min(12, a.docs_hi)), 2)]
    ctx["pos"], ctx["x"] = make_batch(a.seed, first)
    ctx["scale"] = a.head_dim ** -0.5
    ctx["ref"] = reference(ctx["x"], ctx["pos"], ctx["scale"])
    docs = (ctx["pos"] == 0).sum(1)
    info = {"B": a.batch, "S": a.seq, "H": a.heads, "K": a.kv_heads, "Dh": a.head_dim,
            "documents_per_row": docs.tolist(), "documents": int(docs.sum()),
            "length_1_documents": int(sum((np.diff(np.r_[np.flatnonzero(p == 0), a.seq]) == 1).sum() for p in ctx["pos"]))}
    print(f"  {info}")
    return info


def packed(ctx, name: str, capacity: int):
    """Build the packed plans for `capacity` sequences of up to S tokens (one group), run
    forward + backward, compare."""
    att, a = ctx["att"], ARGS
    B, S = a.batch, a.seq
    print(f"  building packed plans: {capacity} sequences", flush=True)
    d = ctx["documents"]
    docs = d.Documents(B, S, (d.Group(0, S, S, capacity),), empty)
    info = {"capacity": capacity}
    fwd = plan(ctx, False, "ragged", docs)
    info["forward_plan"] = describe(fwd)
    bwd = plan(ctx, True, "ragged", docs)
    info["backward_plan"] = describe(bwd)
    ensure_workspace(att, fwd, bwd)
    set_stream(att)
    docs.fill(ctx["pos"])
    out = Outputs()
    x = ctx["x"]
    o, lse, dq, dk, dv = out.buffers()
    ws = att._workspace["ptr"]
    fwd.run([x["q"], x["k"], x["v"], o, lse], ws)
    sync()
    bwd.run([x["q"], x["k"], x["v"], o, x["do"], lse, dq, dk, dv], ws)
    sync()
    info.update(out.checked(ctx["ref"], B * S))
    ctx[name] = (docs, fwd, bwd)
    show(info)
    return info


def st_exact(ctx):
    return packed(ctx, "exact", int((ctx["pos"] == 0).sum()))


def st_padded(ctx):
    return packed(ctx, "padded", ARGS.batch * ARGS.docs_hi)


def st_replay(ctx):
    import torch
    if DEV != "cuda":
        return {"ok": True, "skipped": "no CUDA (emulated)"}
    att, a = ctx["att"], ARGS
    docs, fwd, bwd = ctx["padded"]
    x = {n: t.clone() for n, t in ctx["x"].items()}
    out = Outputs()
    o, lse, dq, dk, dv = out.buffers()
    sync()
    graph = torch.cuda.CUDAGraph()
    ws = att._workspace["ptr"]
    with torch.cuda.graph(graph):
        set_stream(att)  # the capture stream
        fwd.run([x["q"], x["k"], x["v"], o, lse], ws)
        bwd.run([x["q"], x["k"], x["v"], o, x["do"], lse, dq, dk, dv], ws)
    set_stream(att)
    info = {}
    batches = [("other", make_batch(a.seed + 1, [(1, 0), (a.docs_hi, 10), (a.docs_lo, 0)])),
               ("first again", (ctx["pos"], ctx["x"]))]
    for label, (pos, xs) in batches:
        for n in x:
            x[n].copy_(xs[n])
        for f in out.flat.values():
            f[:out.T * (f.numel() // (out.T + a.seq))] = float("nan")
        docs.fill(pos)
        graph.replay()
        sync()
        ref = ctx["ref"] if label == "first again" else reference(xs, pos, ctx["scale"])
        info[label] = out.checked(ref, a.batch * a.seq)
        info[label]["documents_per_row"] = (pos == 0).sum(1).tolist()
        print(f"  replay, {label} batch:")
        show(info[label])
    info["ok"] = all(info[k]["ok"] for k, _ in batches)
    return info


def st_time(ctx):
    att, a = ctx["att"], ARGS
    x = ctx["x"]
    out = Outputs()
    o, lse, dq, dk, dv = out.buffers()
    res = {}
    plain_f, plain_b = plan(ctx, False), plan(ctx, True)
    ctx["plain"] = (plain_f, plain_b)
    res["plain_engines"] = {"forward": describe(plain_f).get("engine"), "backward": describe(plain_b).get("engine")}
    plans = {"plain": (plain_f, plain_b)}
    for name in ("exact", "padded"):
        if name in ctx:
            plans[name] = ctx[name][1:]
            ctx[name][0].fill(ctx["pos"])
    ensure_workspace(att, *(p for pair in plans.values() for p in pair))
    set_stream(att)
    ws = att._workspace["ptr"]
    for name, (f, b) in plans.items():
        res[name] = {"forward_ms": timed(lambda: f.run([x["q"], x["k"], x["v"], o, lse], ws), a.iters),
                     "backward_ms": timed(lambda: b.run([x["q"], x["k"], x["v"], o, x["do"], lse, dq, dk, dv], ws),
                                          a.iters)}
        r = res[name]
        r["fwd_plus_bwd_ms"] = r["forward_ms"] + r["backward_ms"]
        r["x28_layers_ms"] = 28 * r["fwd_plus_bwd_ms"]
    for name in ("exact", "padded"):
        if name in res:
            res[name]["vs_plain"] = res[name]["fwd_plus_bwd_ms"] / res["plain"]["fwd_plus_bwd_ms"]
    if "padded" in ctx:
        docs = ctx["padded"][0]

        def fill():
            docs.fill(ctx["pos"])
            sync()
        res["documents_fill_host_ms"] = timed(fill, a.iters)
    for k, v in res.items():
        print(f"  {k}: {v}")
    return res


def st_tvm(ctx):
    """prepare() + feeder() + the registered functions: the path a compiled step takes, for each
    way a build masks packed documents (ragged with the runtime's PACKED settings, bias)."""
    if ARGS.emulate:
        return {"ok": True, "skipped": "emulated"}
    try:
        import tvm  # noqa: F401
        import tvm_ffi
    except Exception as e:  # noqa: BLE001
        return {"ok": True, "skipped": f"TVM's runtime does not import here ({e}); source bench/h200_env.sh first"}
    from types import SimpleNamespace

    import torch
    from lorac.runtime.devices.cuda import loader
    att, a = ctx["att"], ARGS
    B, S, H, K, Dh = a.batch, a.seq, a.heads, a.kv_heads, a.head_dim
    loader._ensure_cuda_device_api()
    pos = ctx["pos"]
    info = {"packed_settings": dict(att.PACKED)}
    for mask in ("ragged", "bias"):
        att.release()  # plans, documents, handle: prepare() starts afresh as an artifact's load does
        att.reserve_documents(a.docs_hi, int(pos.max()) + 1)
        calls = [{"function": fn, "B": B, "S": S, "H": H, "K": K, "Dh": Dh, "scale": ctx["scale"], "mask": mask}
                 for fn in (att.PACKED_FWD, att.PACKED_BWD)]
        manifest = SimpleNamespace(unit_calls=calls)
        dev = tvm.cuda(0)
        att.prepare(manifest, dev)
        feed = att.feeder(manifest)
        x = ctx["x"]
        if mask == "ragged":
            feed({"position_ids": pos})
            arg = torch.from_numpy(pos).to(DEV)
            lse_shape = (B, S, H, 1)
        else:
            arg = torch.from_numpy(ctx["documents"].document_bias(pos)).to(DEV).to(torch.bfloat16)
            lse_shape = (B, H, S, 1)
        out = Outputs()
        o, lse, dq, dk, dv = out.buffers()
        lse_b = torch.empty(lse_shape, dtype=torch.float32, device=DEV)
        tv = tvm.runtime.from_dlpack
        sync()
        tvm_ffi.get_global_func(att.PACKED_FWD)(tv(x["q"]), tv(x["k"]), tv(x["v"]), tv(arg), tv(o.view(B, S, H, Dh)),
                                               tv(lse_b))
        tvm_ffi.get_global_func(att.PACKED_BWD)(tv(x["q"]), tv(x["k"]), tv(x["v"]), tv(o.view(B, S, H, Dh)),
                                               tv(x["do"]), tv(lse_b), tv(arg), tv(dq.view(B, S, H, Dh)),
                                               tv(dk.view(B, S, K, Dh)), tv(dv.view(B, S, K, Dh)))
        dev.sync()
        sync()
        lse[:B * S].copy_((lse_b if mask == "ragged" else lse_b.permute(0, 2, 1, 3)).reshape(B * S, H, 1))
        info[mask] = out.checked(ctx["ref"], B * S)
        if mask == "ragged":
            docs = att._documents[(B, S)]
            info[mask]["groups"] = [vars(g) for g in docs.groups]
        print(f"  mask {mask}:")
        show(info[mask])
    info["ok"] = info["ragged"]["ok"] and info["bias"]["ok"]
    return info


def main(argv=None) -> int:
    global ARGS, DEV
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", help="write the report here (rewritten after each stage)")
    p.add_argument("--emulate", action="store_true", help="CPU, cuDNN's frontend emulated (tests/_cudnn_emulator.py)")
    p.add_argument("--variants", action="store_true", help="run the variants (and the speed stage) even when the "
                   "runtime's path passed")
    p.add_argument("--speed", action="store_true", help="run the speed stage (bench/cudnn_isolated_speed.py)")
    p.add_argument("--only", help="the speed stage's variants, comma-separated (plain always; engines:NAME for an "
                                  "engines table)")
    p.add_argument("--batch", type=int)
    p.add_argument("--seq", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--kv-heads", type=int)
    p.add_argument("--head-dim", type=int)
    p.add_argument("--docs-lo", type=int, default=4)
    p.add_argument("--docs-hi", type=int, default=40)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    ARGS = p.parse_args(argv)
    if ARGS.only:
        from cudnn_isolated_speed import chosen
        try:
            chosen(ARGS.only)
        except ValueError as e:
            p.error(str(e))
    small = dict(batch=2, seq=96, heads=4, kv_heads=2, head_dim=16)
    full = dict(batch=8, seq=1024, heads=16, kv_heads=8, head_dim=128)
    for k, v in (small if ARGS.emulate else full).items():
        if getattr(ARGS, k) is None:
            setattr(ARGS, k, v)
    if ARGS.emulate:
        ARGS.docs_hi, ARGS.iters = min(ARGS.docs_hi, 12), min(ARGS.iters, 2)
    DEV = "cpu" if ARGS.emulate else "cuda"
    C.ARGS, C.DEV = ARGS, DEV
    REPORT["args"] = vars(ARGS)
    ctx: dict = {}
    if not stage("env", st_env, ctx)["ok"]:
        return 2
    if not stage("data", st_data, ctx)["ok"]:
        return 2
    exact, padded = stage("exact", st_exact, ctx), stage("padded", st_padded, ctx)
    replay = stage("replay", st_replay, ctx) if "padded" in ctx else {"ok": False}
    stage("time", st_time, ctx)
    if ARGS.variants or not (exact["ok"] and padded["ok"]):
        from cudnn_isolated_variants import st_variants
        stage("variants", st_variants, ctx)
    if ARGS.variants or ARGS.speed:
        from cudnn_isolated_speed import st_speed
        stage("speed", st_speed, ctx)
    stage("tvm", st_tvm, ctx)
    ok = exact["ok"] and padded["ok"] and replay["ok"]
    REPORT["ok"] = ok
    save()
    att = ctx.pop("att", None)
    ctx.clear()  # the plans built here go before the handle does, so the exit prints no nanobind leak report
    if att is not None:
        att.release()
    print("\n== summary: " + ", ".join(f"{k} {'ok' if v['ok'] else 'FAILED'}" for k, v in REPORT["stages"].items()))
    t = REPORT["stages"].get("time", {})
    if "plain" in t:
        print("   fwd+bwd ms: " + ", ".join(f"{k} {v['fwd_plus_bwd_ms']:.3f}" for k, v in t.items() if isinstance(v, dict)
                                        and "fwd_plus_bwd_ms" in v))
    return 0 if ok else 1


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.exit(code)
