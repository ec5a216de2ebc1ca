"""The speed stage of bench/cudnn_isolated_check.py: ways to make the packed attention call
faster, each built with lorac's runtime (runtime/devices/cuda/sdpa.py, documents.py), checked
against the fp32 reference per document and timed (fwd, bwd: median of --iters) against the
plain causal call on the same tensors, on two batches:

  main   the check's batch (rows of --docs-lo..--docs-hi documents: long documents too)
  short  rows of 24..40 documents (as chat data packs: no document past a few hundred tokens)

Variants (a name, the packed layout, lorac's attention.PACKED settings):
  ragged_row            each document a ragged sequence, plans of S tokens (the first build)
  ragged_longest        plans as long as the batch's longest document, rounded up to 64
                        (PACKED["max_seq"] = "longest": the data's longest, reserve_documents)
  ragged_groups_*       documents split by length into groups at those bounds, a plan each
                        (PACKED["bounds"]); `outside_writes` counts the values group 0's plans
                        alone wrote outside group 0's documents (must be 0 for groups to work)
  ragged_deterministic  the backward's use_deterministic_algorithm
  ragged_composite/unified  the forward's cuDNN implementation
  bias                  plain rows + the documents' bias [B, 1, S, S] (mask "bias": the whole
                        causal triangle computed, no host work per step)
  bias_unified          the same, the forward's implementation UNIFIED
  bias_fp32             the bias in fp32 (should cuDNN refuse a bf16 one)
  bias_band             the bias, and the causal band cut one key past the batch's longest
                        document (diagonal_band_left_bound: tiles further back not computed)
  kernel                not cuDNN: lorac's Triton kernels (compiler/targets/cuda/packed_kernels.py),
                        each kernel's block configurations timed (bench/packed_kernels_bench.py)
and `engines`: every plan cuDNN's heuristics offer for the ragged_longest and bias graphs,
each timed alone (forward plans with the default backward, and the other way round).
What the runtime picks from this: attention.PACKED (ragged) and PACKED_MASK in
compiler/targets/cuda/attention.py (kernel, ragged or bias). `--only NAME,...` (cudnn_isolated_check.py) runs
those variants alone, and an engines table only where named (engines:ragged_longest, engines:bias).
"""
from __future__ import annotations

import traceback

import numpy as np

import cudnn_isolated_common as C
from cudnn_isolated_common import Outputs, describe, empty, ensure_workspace, make_batch, plan, reference, set_stream, sync, timed

VARIANTS = {  # name: (layout, settings); settings as attention.PACKED's keys
    "plain": ("causal", {}),
    "ragged_row": ("ragged", {"max_seq": "row"}),
    "ragged_longest": ("ragged", {"max_seq": "longest"}),
    "ragged_groups_64": ("ragged", {"max_seq": "longest", "bounds": (64,)}),
    "ragged_groups_128": ("ragged", {"max_seq": "longest", "bounds": (128,)}),
    "ragged_groups_256": ("ragged", {"max_seq": "longest", "bounds": (256,)}),
    "ragged_groups_64_256": ("ragged", {"max_seq": "longest", "bounds": (64, 256)}),
    "ragged_groups_128_512": ("ragged", {"max_seq": "longest", "bounds": (128, 512)}),
    "ragged_deterministic": ("ragged", {"max_seq": "longest", "deterministic": True}),
    "ragged_composite": ("ragged", {"max_seq": "longest", "implementation": "COMPOSITE"}),
    "ragged_unified": ("ragged", {"max_seq": "longest", "implementation": "UNIFIED"}),
    "bias": ("bias", {}),
    "bias_unified": ("bias", {"implementation": "UNIFIED"}),
    "bias_fp32": ("bias", {"bias_dtype": "float32"}),  # in case cuDNN refuses a bf16 bias
    "bias_band": ("bias", {"band": "longest"}),
    "kernel": ("kernel", {}),  # lorac's Triton kernels (bench/packed_kernels_bench.py), not cuDNN
}
SHORT = ("plain", "ragged_row", "ragged_longest", "ragged_groups_64", "ragged_groups_128", "ragged_groups_64_256",
         "bias", "bias_band", "kernel")


ENGINES = ("ragged_longest", "bias")  # the variants whose every offered plan `engines` times


def chosen(only: str | None) -> list[str]:
    """The names of --only (comma-separated); a ValueError naming the choices for any other."""
    names = [x for x in (only or "").split(",") if x]
    unknown = [x for x in names if x not in VARIANTS and x not in {f"engines:{e}" for e in ENGINES}]
    if unknown:
        raise ValueError(f"--only {','.join(unknown)}: not a variant; the variants: {', '.join(VARIANTS)}, "
                         + ", ".join(f"engines:{e}" for e in ENGINES))
    return names


def datasets(ctx) -> dict:
    """name -> (positions, inputs, reference, documents a row at most)."""
    a = C.ARGS
    lo, hi = (24, 40) if a.seq >= 512 else (max(2, a.seq // 8), max(3, a.seq // 4))
    pos, x = make_batch(a.seed + 7, [], lo, hi)
    return {"main": (ctx["pos"], ctx["x"], ctx["ref"], a.docs_hi),
            "short": (pos, x, reference(x, pos, ctx["scale"]), hi)}


def build(ctx, layout: str, settings: dict, pos, per_row: int, engines: dict | None = None):
    """(forward plans, backward plans, documents or None) of a variant, documents filled."""
    a, d = C.ARGS, ctx["documents"]
    opts = {k: settings[k] for k in ("deterministic", "implementation", "bias_dtype") if settings.get(k)}
    if settings.get("band") == "longest":  # the runtime's band for the batch's longest document
        opts["band"] = ctx["att"].band(a.seq, int(pos.max()) + 1)
    docs = None
    if layout == "ragged":
        longest = int(pos.max()) + 1 if settings.get("max_seq", "longest") == "longest" else None
        docs = d.Documents(a.batch, a.seq, d.groups_for(a.batch, a.seq, per_row, longest, settings.get("bounds", ())),
                           empty)
        docs.fill(pos)
    n = len(docs.groups) if docs else 1
    eng = engines or {}
    fwd = [plan(ctx, False, layout, docs, g, {**opts, "engine": eng.get("fwd")}) for g in range(n)]
    bwd = [plan(ctx, True, layout, docs, g, {**opts, "engine": eng.get("bwd")}) for g in range(n)]
    ensure_workspace(ctx["att"], *fwd, *bwd)
    return fwd, bwd, docs


def run_and_time(ctx, layout, fwd, bwd, pos, x, ref, check=True) -> dict:
    """Run forward then backward once, compare with `ref` (packed layouts), time each."""
    import torch
    a, att = C.ARGS, ctx["att"]
    B, S, H = a.batch, a.seq, a.heads
    out = Outputs()
    o, lse, dq, dk, dv = out.buffers()
    lse_b = lse if layout == "ragged" else torch.empty((B, H, S, 1), dtype=torch.float32, device=C.DEV)
    bufs = {**x, "o": o, "lse": lse_b, "dq": dq, "dk": dk, "dv": dv}
    if layout == "bias":
        wide = fwd[0].options.get("bias_dtype") == "float32"
        bufs["bias"] = torch.from_numpy(ctx["documents"].document_bias(pos)).to(C.DEV).to(
            torch.float32 if wide else torch.bfloat16)
    fb, bb = [bufs[n] for n in fwd[0].names], [bufs[n] for n in bwd[0].names]
    ws = att._workspace["ptr"]
    set_stream(att)

    def forward():
        for p in fwd:
            p.run(fb, ws)

    def backward():
        for p in bwd:
            p.run(bb, ws)
    forward()
    backward()
    sync()
    if check and layout != "causal":
        if layout == "bias":
            lse[:B * S].copy_(lse_b.permute(0, 2, 1, 3).reshape(B * S, H, 1))
        res = out.checked(ref, B * S)
        res = {"ok": res["ok"], **{k: round(res[k]["cosine"], 7) for k in ("o", "dq", "dk", "dv")},
               "guard_untouched": all(res["guard_untouched"].values())}
    else:
        res = {"ok": True}
    res["forward_ms"], res["backward_ms"] = timed(forward, a.iters), timed(backward, a.iters)
    res["fwd_plus_bwd_ms"] = res["forward_ms"] + res["backward_ms"]
    return res


def outside_writes(ctx, fwd, bwd, docs, pos, x) -> int:
    """Values group 0's plans alone write outside group 0's documents (o, dq, dk, dv)."""
    a = C.ARGS
    lengths, starts = ctx["documents"].document_runs(pos)
    g = docs.groups[0]
    mine = np.zeros(a.batch * a.seq, bool)
    for s, n in zip(starts.tolist(), lengths.tolist()):
        if g.lo < n <= g.hi:
            mine[s:s + n] = True
    out = Outputs()
    o, lse, dq, dk, dv = out.buffers()
    bufs = {**x, "o": o, "lse": lse, "dq": dq, "dk": dk, "dv": dv}
    ws = ctx["att"]._workspace["ptr"]
    fwd[0].run([bufs[n] for n in fwd[0].names], ws)
    bwd[0].run([bufs[n] for n in bwd[0].names], ws)
    sync()
    import torch
    T, other = a.batch * a.seq, torch.from_numpy(~mine).to(C.DEV)
    return int(sum((~out.view[n][:T][other].isnan()).sum() for n in ("o", "dq", "dk", "dv")))


def cudnn_variant(ctx, layout, settings, pos, x, ref, per_row) -> dict:
    """Build a cuDNN variant's plans, run, check and time them."""
    fwd, bwd, docs = build(ctx, layout, settings, pos, per_row)
    r = run_and_time(ctx, layout, fwd, bwd, pos, x, ref)
    r["engines"] = {"forward": [describe(p).get("engine") for p in fwd],
                    "backward": [describe(p).get("engine") for p in bwd]}
    if docs is not None:
        r["groups"] = [(g.lo, g.hi, g.max_seq, g.capacity) for g in docs.groups]
        if len(docs.groups) > 1:
            r["outside_writes"] = outside_writes(ctx, fwd, bwd, docs, pos, x)
            r["ok"] = r["ok"] and r["outside_writes"] == 0
    return r


def st_speed(ctx):
    res = {"variants": {}, "engines": {}}
    data = datasets(ctx)
    only = chosen(getattr(C.ARGS, "only", None))
    for dname, (pos, x, ref, per_row) in data.items():
        res["variants"][dname] = table = {}
        res[f"{dname}_documents"] = {"per_row": (pos == 0).sum(1).tolist(), "longest": int(pos.max()) + 1}
        for name, (layout, settings) in VARIANTS.items():
            if (only and name not in only and name != "plain") or (dname == "short" and name not in SHORT):
                continue
            try:
                if layout == "kernel":
                    import packed_kernels_bench
                    r = packed_kernels_bench.variant(ctx, pos, x, ref)
                else:
                    r = cudnn_variant(ctx, layout, settings, pos, x, ref, per_row)
            except Exception as e:  # noqa: BLE001 - each variant reports on its own
                print(traceback.format_exc()[-1500:], flush=True)
                r = {"ok": False, "error": f"{type(e).__name__}: {str(e).strip()[:1500]}"}
            table[name] = r
            plain = table.get("plain", {}).get("fwd_plus_bwd_ms")
            if plain and "fwd_plus_bwd_ms" in r:
                r["vs_plain"] = round(r["fwd_plus_bwd_ms"] / plain, 3)
            print(f"  {dname:5s} {name:24s} " + (f"fwd {r['forward_ms']:.4f}  bwd {r['backward_ms']:.4f}  "
                                                   f"total {r['fwd_plus_bwd_ms']:.4f} ms  x{r.get('vs_plain', 1):.3f}  "
                                                   f"{'ok' if r['ok'] else 'FAILED'}" if "forward_ms" in r
                                                   else f"FAILED: {r.get('error', '')[:200]}"), flush=True)
    pos, x, ref, per_row = data["main"]
    for name in ENGINES:
        if not only or f"engines:{name}" in only:
            res["engines"][name] = engines(ctx, *VARIANTS[name], pos, x, ref, per_row)
    res["ok"] = True  # informative: the choice is the reader's
    return res


def engines(ctx, layout, settings, pos, x, ref, per_row) -> dict:
    """Every plan the heuristics offer for this variant's graphs, each timed with the default
    plan of the other direction."""
    out = {}
    try:
        fwd, bwd, _ = build(ctx, layout, settings, pos, per_row)
        names = {"fwd": fwd[0].plan_names(), "bwd": bwd[0].plan_names()}
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {str(e).strip()[:1000]}"}
    out["offered"] = names
    for side in ("fwd", "bwd"):
        for name in names[side]:
            try:
                f, b, _ = build(ctx, layout, settings, pos, per_row, {side: name})
                r = run_and_time(ctx, layout, f, b, pos, x, ref)
            except Exception as e:  # noqa: BLE001
                r = {"ok": False, "error": f"{type(e).__name__}: {str(e).strip()[:500]}"}
            out[f"{side}:{name}"] = r
            print(f"  engines {layout:6s} {side} {name:28s} " + (f"fwd {r['forward_ms']:.4f}  bwd {r['backward_ms']:.4f}"
                                                                   f"  {'ok' if r['ok'] else 'FAILED'}"
                                                                   if "forward_ms" in r else "FAILED"), flush=True)
    return out
