"""Isolated packing on the H200, whole steps: the Qwen3-0.6B shape 8x1024 with rows of 4-40
documents against the plain step (issue 28: <= 1.05x), and the bf16 step's loss and LoRA
gradients against the fp32 CPU step of each document alone (loss 1e-2 relative, cosines >= 0.999).

    .venv/bin/python bench/h200_packed_step.py prepare CACHE      # here: compile; the fp32 references
    source bench/h200_env.sh                                      # the GPU machine: runtime-only TVM
    python3 bench/h200_packed_step.py device CACHE [VARIANT ...] [--json FILE] [--skip-equality]

prepare compiles, the way bench/h200_vs_peers.py prepares its cases (its helpers): the plain
step and the isolated one, once for each way the CUDA build masks documents
(compiler/targets/cuda/attention.py PACKED_MASK: CACHE/ragged with the plain step, CACHE/bias,
CACHE/kernel),
with the optimizer; and for the
equality a small Qwen3 (2 layers, GQA 4/2, head_dim 64) at 4x256, isolated, bf16 CUDA in both
masks, with its inputs (random weights, LoRA A and B, packed rows) and the reference: the
fp32 CPU step over the same documents, each alone in a row of its own (plain causal, the rest
of the row padding whose labels count nothing: the same loss, the token-weighted mean of the
documents' losses, and the same gradients), checked here against the fp32 CPU isolated step.

device runs each part in a process of its own and prints one JSON line each, then a table:
  equality MASK   the small artifact, first called on other rows (the CUDA graph is captured
                  then), then on the checked rows: loss and every LoRA gradient vs the reference
  time VARIANT    the plain and the isolated 0.6B engines (random weights, as h200_vs_peers),
                  full steps (step + LoRA+ AdamW update, h200_vs_peers.full_step) alternating,
                  the order swapped every round; medians and isolated / plain
VARIANTS: ragged (the runtime's default settings: plans of S tokens, as first built),
ragged_longest (plans as long as the longest document), ragged_groups_128 (and documents
split at 128 tokens), bias (the bias build), kernel (lorac's Triton kernels, the default where
Triton is installed); or MASK=JSON, the
runtime's attention.PACKED settings for an artifact of that mask: 'ragged={"bounds": [64, 256]}'; any of
them with @LO-HI times rows of LO-HI documents instead of 4-40 (bias@24-40: short documents, as chat
data packs, where the bias plans' causal band skips most tiles). PACKED_ROWS=BxS (both modes) times
other rows than 8x1024 (past 1024 tokens the build masks by ragged sequences alone). `--stand-in cpu`
runs the same flow with small CPU fp32 artifacts (tests/test_packed_step.py), no GPU.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import h200_vs_peers as hv  # noqa: E402
from cudnn_isolated_common import row_lengths  # noqa: E402

MASKS = ("ragged", "bias", "kernel")
VARIANTS = {  # name: (the artifact's mask, runtime attention.PACKED settings)
    "ragged": ("ragged", {}),
    "ragged_longest": ("ragged", {"max_seq": "longest"}),
    "ragged_groups_128": ("ragged", {"max_seq": "longest", "bounds": (128,)}),
    "bias": ("bias", {}),
    "kernel": ("kernel", {}),
}
SMALL = dict(model_type="qwen3", vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True)
TINY = {**SMALL, "hidden_size": 64, "head_dim": 16, "intermediate_size": 128}  # the CPU stand-in's timing shape
ROWS = os.environ.get("PACKED_ROWS", "8x1024")  # the Qwen3-0.6B rows timed, BxS (the same in prepare and device)
PLAIN = f"q06-{ROWS}"
hv.CASES.setdefault(PLAIN, (*hv.CASES["q06-8x1024"][:2], *(int(x) for x in ROWS.split("x")), hv.CASES["q06-8x1024"][4], []))
hv.CASES[f"{PLAIN}-isolated"] = (*hv.CASES[PLAIN][:4], {**hv.CASES[PLAIN][4], "packing": "isolated"}, [])
hv.CASES["tiny-2x64"] = (TINY, "-", 2, 64, {}, [])
hv.CASES["tiny-2x64-isolated"] = (TINY, "-", 2, 64, {"packing": "isolated"}, [])
EQ_B, EQ_S, DOCS = 4, 256, (4, 40)
STAND_IN_EQ = (2, 64)  # the CPU stand-in's equality rows


def setup(stand_in: str | None) -> dict:
    if stand_in:
        return {"target": stand_in, "dtype": "float32", "plain": "tiny-2x64", "isolated": "tiny-2x64-isolated"}
    return {"target": "cuda", "dtype": "bfloat16", "plain": PLAIN, "isolated": f"{PLAIN}-isolated"}


# -- packed rows -----------------------------------------------------------------------------
def packed_positions(seed: int, B: int, S: int, lo: int = DOCS[0], hi: int = DOCS[1]) -> np.ndarray:
    """[B, S] position ids of rows of lo..hi documents of random lengths (1-3 of them one token
    long; the first row lo documents, the second hi: both ends of the range)."""
    rng = np.random.default_rng(seed)
    rows = []
    for b in range(B):
        n = lo if b == 0 else hi if b == 1 else int(rng.integers(lo, hi + 1))
        n = min(n, S)
        rows.append(np.concatenate([np.arange(x) for x in row_lengths(rng, S, n, min(n, int(rng.integers(1, 4))))]))
    return np.stack(rows).astype(np.int64)


def packed_batch(ids: np.ndarray, pos: np.ndarray) -> dict:
    """As the data pipeline writes isolated rows: each document's first label -100."""
    labels = ids.copy()
    labels[pos == 0] = -100
    return {"input_ids": ids, "labels": labels, "position_ids": pos}


def documents_of(*positions) -> tuple[int, int]:
    """(the most documents a row holds, the longest document) of these batches: what the
    runtime reserves from the run's data."""
    per_row = max(int((p == 0).sum(1).max()) for p in positions)
    longest = max(int(p.max()) + 1 for p in positions)
    return per_row, longest


# -- the small model's equality ------------------------------------------------------------
def small_specs(stand_in: str | None, n_docs: int = 1):
    """(spec, the isolated TrainSpec at EQ_B x EQ_S, the plain one with a row per document)."""
    from lorac.graphs import ModelSpec, TrainSpec
    from lorac.graphs.families import for_spec
    spec = ModelSpec.from_hf_config(SMALL)
    fam = for_spec(spec)
    B, S = STAND_IN_EQ if stand_in else (EQ_B, EQ_S)
    kw = dict(lora_targets=fam.TARGETS, rank=8, alpha=16)
    return (spec, TrainSpec(batch=B, seq=S, packing="isolated", **kw),
            TrainSpec(batch=n_docs, seq=S, packing="plain", **kw))


def small_engine(spec, train, weights, target, dtype, cache):
    from lorac.runtime.engine.tvm import Engine
    from lorac.runtime.train.optim import LoraPlusConfig
    return Engine(spec, train, weights, target, dtype, cache, LoraPlusConfig(lr=1e-4, loraplus_ratio=16.0),
                  log=lambda m: print(m, flush=True))


def small_inputs(spec, train, cache: Path) -> dict:
    """Random fp32 weights (HF-like scales; names and shapes from the compiled step's manifest),
    LoRA A and B (B nonzero: A's gradients count) and two packed batches (the checked one and
    the one the first call captures on)."""
    from lorac.runtime.engine.artifact import read_manifest
    eng = small_engine(spec, train, {}, "cpu", "float32", cache)
    rng = np.random.default_rng(11)
    weights = {i["name"]: (np.ones(i["shape"], np.float32) if "norm" in i["name"] else
                           (0.05 * rng.standard_normal(i["shape"])).astype(np.float32))
               for i in read_manifest(eng.compile("train"))["inputs"]
               if i["name"] not in ("input_ids", "labels", "position_ids") and not i["name"].endswith(".param")}
    lora = {n: (0.05 * rng.standard_normal(shape)).astype(np.float32) for n, shape in eng.shapes.items()}
    out = {f"w:{k}": v for k, v in weights.items()} | {f"l:{k}": v for k, v in lora.items()}
    for name, seed in (("check", 21), ("other", 22)):
        pos = packed_positions(seed, train.batch, train.seq)
        ids = rng.integers(0, spec.vocab, pos.shape).astype(np.int64)
        out.update({f"{name}:{k}": v for k, v in packed_batch(ids, pos).items()})
    return out


def split(inputs: dict, prefix: str) -> dict:
    return {k[len(prefix):]: v for k, v in inputs.items() if k.startswith(prefix)}


def per_tensor_grads(eng, out: dict) -> dict:
    """A step's flat gradients (graphs/optimizer.Bucket) as {LoRA tensor name: array}."""
    grads = {}
    for b in eng._buckets:
        flat = out[f"{b.key}.grad"]
        flat = flat if isinstance(flat, np.ndarray) else flat.numpy()
        for name, offset, shape in b.entries:
            grads[name] = np.asarray(flat[offset:offset + int(np.prod(shape))], np.float64).reshape(shape)
    return grads


def step_once(eng, lora, batch) -> tuple[float, dict]:
    zeros = {n: np.zeros_like(a) for n, a in lora.items()}
    eng.set_state(lora, zeros, dict(zeros))
    out = eng.step(batch, eng.lora)
    return float(out["loss"]), per_tensor_grads(eng, out)


def alone_rows(batch: dict) -> dict:
    """Each document of the packed rows alone at the start of a row of its own (positions from
    0, plain causal), the rest of the row padding whose labels are -100."""
    ids, labels, pos = batch["input_ids"], batch["labels"], batch["position_ids"]
    S = ids.shape[1]
    rows = []
    for b in range(ids.shape[0]):
        starts = list(np.flatnonzero(pos[b] == 0)) + [S]
        rows += [(b, a, e) for a, e in zip(starts, starts[1:])]
    out_ids, out_labels = np.zeros((len(rows), S), np.int64), np.full((len(rows), S), -100, np.int64)
    for r, (b, a, e) in enumerate(rows):
        out_ids[r, :e - a], out_labels[r, :e - a] = ids[b, a:e], labels[b, a:e]
    return {"input_ids": out_ids, "labels": out_labels}


def compare(loss: float, grads: dict, ref_loss: float, ref: dict) -> dict:
    cos = {n: float((g * ref[n]).sum() / (np.linalg.norm(g) * np.linalg.norm(ref[n]))) for n, g in grads.items()}
    rel = {n: float(np.abs(g - ref[n]).max() / np.abs(ref[n]).max()) for n, g in grads.items()}
    worst = min(cos, key=cos.get)
    return {"loss": loss, "ref_loss": ref_loss, "loss_rel": abs(loss - ref_loss) / abs(ref_loss),
            "min_cos": cos[worst], "min_cos_tensor": worst, "max_rel": max(rel.values()), "tensors": len(cos)}


def prepare_equality(cache: Path, stand_in: str | None) -> dict:
    spec, train, _ = small_specs(stand_in)
    inputs = small_inputs(spec, train, cache / "cpu")
    np.savez(cache / "equality_inputs.npz", **inputs)
    weights, lora, batch = split(inputs, "w:"), split(inputs, "l:"), split(inputs, "check:")
    alone = alone_rows(batch)
    _, _, train_alone = small_specs(stand_in, alone["input_ids"].shape[0])
    ref_loss, ref = step_once(small_engine(spec, train_alone, weights, "cpu", "float32", cache / "cpu"), lora, alone)
    np.savez(cache / "equality_ref.npz", loss=np.float64(ref_loss), **ref)
    packed = compare(*step_once(small_engine(spec, train, weights, "cpu", "float32", cache / "cpu"), lora, batch),
                     ref_loss, ref)  # the CPU side of the equality: fp32, to 1e-5
    info = {"documents": int(alone["input_ids"].shape[0]), "cpu_fp32_isolated_vs_alone": packed}
    print("equality reference:", json.dumps(info), flush=True)
    assert packed["loss_rel"] < 1e-5 and packed["min_cos"] > 1 - 1e-6, packed
    for mask in MASKS if not stand_in else ():  # the bf16 CUDA artifacts, one per mask: the step and the eval loss
        eng = small_engine(spec, train, weights, "cuda", "bfloat16", cache / mask)
        for kind in ("train", "eval"):
            with_mask(mask, lambda: eng.compile(kind))
    return info


def with_mask(mask: str, fn):
    """fn() with the CUDA build masking packed documents by `mask`."""
    from lorac.compiler.targets.cuda import attention as cuda_attention
    saved = cuda_attention.PACKED_MASK
    cuda_attention.PACKED_MASK = mask
    try:
        return fn()
    finally:
        cuda_attention.PACKED_MASK = saved


def prepare(cache: str, stand_in: str | None) -> None:
    from lorac.core.keys import versions
    root = Path(cache)
    root.mkdir(parents=True, exist_ok=True)
    (root / hv.SOURCE_FILE).write_text(versions()["lorac_source"] + "\n")
    s = setup(stand_in)
    t0 = time.time()
    # CACHE/ragged: the plain step, the isolated one masking documents as ragged sequences and the
    # optimizer; CACHE/bias and CACHE/kernel: the isolated step masking them by a bias or by
    # lorac's kernels, and the optimizer. The CPU
    # stand-in has no masks (its attention is inlined): CACHE/ragged alone
    for mask, case, kind in [("ragged", s["plain"], "train"), ("ragged", s["isolated"], "train"),
                             ("ragged", s["plain"], "adamw"), ("bias", s["isolated"], "train"),
                             ("bias", s["plain"], "adamw"), ("kernel", s["isolated"], "train"),
                             ("kernel", s["plain"], "adamw")][:None if not stand_in else 3]:
        art = with_mask(mask, lambda: hv._engine(case, str(root / mask), target=s["target"])[0].compile(kind))
        m = json.loads((art / "manifest.json").read_text())
        print(mask, case, kind, art.name, [c.get("mask") for c in m.get("unit_calls", [])], flush=True)
    info = prepare_equality(root, stand_in)
    (root / "prepared.json").write_text(json.dumps({"stand_in": stand_in, "seconds": round(time.time() - t0), **info}))


# -- device parts (each in a process of its own) --------------------------------------------
def masks_of(art: Path) -> set:
    m = json.loads((art / "manifest.json").read_text())
    return {c.get("mask", "ragged") for c in m.get("unit_calls", []) if "packed" in c["function"]}


def equality(cache: str, mask: str, stand_in: str | None) -> dict:
    from lorac.runtime import devices
    s = setup(stand_in)
    root = Path(cache)
    inputs = dict(np.load(root / "equality_inputs.npz"))
    ref = dict(np.load(root / "equality_ref.npz"))
    ref_loss = float(ref.pop("loss"))
    spec, train, _ = small_specs(stand_in)
    batch, other = split(inputs, "check:"), split(inputs, "other:")
    devices.get(s["target"]).reserve_documents(*documents_of(batch["position_ids"], other["position_ids"]))
    eng = small_engine(spec, train, split(inputs, "w:"), s["target"], s["dtype"], root / (mask if not stand_in else "cpu"))
    art = eng.compile("train")
    if not stand_in and masks_of(art) != {mask}:
        raise SystemExit(f"{art} masks documents by {masks_of(art)}, not {mask}")
    lora = split(inputs, "l:")
    step_once(eng, lora, other)  # the first call: a CUDA graph captured on other documents
    loss, grads = step_once(eng, lora, batch)
    r = {"equality": mask, **compare(loss, grads, ref_loss, ref)}
    # the eval artifact (the packed forward alone; with lorac's kernels, the forward kernel alone)
    r["eval_loss"] = float(eng.eval_loss(batch, eng.lora)) if not stand_in else loss
    r["eval_loss_rel"] = abs(r["eval_loss"] - ref_loss) / abs(ref_loss)
    r["ok"] = r["loss_rel"] <= 1e-2 and r["min_cos"] >= 0.999 and r["eval_loss_rel"] <= 1e-2
    return r


def variant_of(name: str) -> tuple[str, dict]:
    """A VARIANTS name, or MASK=JSON of attention.PACKED settings ('ragged={"bounds": [64, 256]}')."""
    if name in VARIANTS:
        return VARIANTS[name]
    mask, _, settings = name.partition("=")
    if mask not in MASKS:
        raise SystemExit(f"variant {name!r}: one of {', '.join(VARIANTS)}, or MASK=JSON with MASK in {MASKS}")
    settings = json.loads(settings or "{}")
    if "bounds" in settings:
        settings["bounds"] = tuple(settings["bounds"])
    return mask, settings


def timing(cache: str, variant: str, stand_in: str | None, rounds: int = 10) -> dict:
    from lorac.runtime import devices
    sys.modules["torch"] = None  # lorac's process needs no torch
    s = setup(stand_in)
    variant, _, docs = variant.partition("@")
    lo, hi = (int(x) for x in docs.split("-")) if docs else DOCS
    mask, settings = variant_of(variant)
    if s["target"] == "cuda":
        from lorac.runtime.devices.cuda import attention
        attention.PACKED.update(settings)
    root = Path(cache)
    plain, spec, optim, _, ids, base = hv.case_engine(str(root / "ragged"), s["plain"], target=s["target"])
    B, S = hv.CASES[s["plain"]][2:4]
    pos = [packed_positions(100 + i, B, S, lo, hi) for i in range(len(ids))]
    per_row, longest = documents_of(*pos)
    devices.get(s["target"]).reserve_documents(per_row, longest)  # before the isolated artifact loads
    iso, _, _, m, _, _ = hv.case_engine(str(root / (mask if not stand_in else "ragged")), s["isolated"],
                                        target=s["target"])
    if s["target"] == "cuda" and masks_of(iso.compile("train")) != {mask}:
        raise SystemExit(f"CACHE/{mask}'s isolated artifact does not mask documents by {mask}")
    packed = [packed_batch(x, p) for x, p in zip(ids, pos)]
    for t in range(1, 4):  # warm-up: capture, plans, first updates
        hv.full_step(plain, optim, ids[t % len(ids)], t)
        hv.full_step(iso, optim, packed[t % len(ids)], t)
    times = {"plain": [], "isolated": []}
    losses = []
    for r in range(rounds):
        order = (("plain", plain, ids), ("isolated", iso, packed))[::1 if r % 2 == 0 else -1]
        for name, eng, batches in order:
            t0 = time.perf_counter()
            loss = hv.full_step(eng, optim, batches[r % len(batches)], 4 + r)
            times[name].append((time.perf_counter() - t0) * 1e3)
            if name == "isolated":
                losses.append(round(loss, 5))
    p, i = float(np.median(times["plain"])), float(np.median(times["isolated"]))
    out = {"time": variant + (f"@{docs}" if docs else ""), "mask": mask, "settings": settings, "plain_ms": round(p, 2), "isolated_ms": round(i, 2),
           "ratio": round(i / p, 4), "round_ratios": [round(b / a, 3) for a, b in zip(times["plain"], times["isolated"])],
           "documents_per_row": [int(x) for x in (pos[0] == 0).sum(1)], "per_row": per_row, "longest": longest,
           "isolated_losses": losses[:3], "ok": bool(np.isfinite(losses).all())}
    if s["target"] == "cuda":
        out["gpu_gb"] = round((hv._gpu_used() - base) / 1e9, 2)
        out["groups"] = [vars(g) for d in attention._documents.values() for g in d.groups]
    return out


def device(cache: str, variants: list[str], stand_in: str | None, json_out: str | None, equal: bool = True) -> int:
    hv.pin_source(cache)
    rows = []
    extra = ["--stand-in", stand_in] if stand_in else []
    parts = [("equality", m) for m in (MASKS if not stand_in else ("ragged",)) if equal] + \
        [("time", v) for v in variants]
    for kind, what in parts:
        t0 = time.time()
        r = subprocess.run([sys.executable, __file__, kind, cache, what, *extra], capture_output=True, text=True,
                           timeout=600)
        got = [x for x in hv._json_lines(r.stdout) if kind in x]
        row = got[0] if got else {kind: what, "ok": False,
                                  "error": (r.stderr.strip().splitlines() or ["?"])[-1][:600]}
        row["seconds"] = round(time.time() - t0, 1)
        print(json.dumps(row), flush=True)
        rows.append(row)
        if json_out:
            Path(json_out).write_text(json.dumps(rows, indent=1))
    print("\n| part | result | ok |\n|---|---|---|")
    for r in rows:
        if "equality" in r and "loss_rel" in r:
            res = (f"loss {r['loss']:.6f} vs {r['ref_loss']:.6f} (rel {r['loss_rel']:.2e}), min cos {r['min_cos']:.6f}, "
                   f"eval loss rel {r.get('eval_loss_rel', float('nan')):.2e}")
        elif "ratio" in r:
            res = f"plain {r['plain_ms']} ms, isolated {r['isolated_ms']} ms: {r['ratio']:.3f}x"
        else:
            res = r.get("error", "?")
        print(f"| {r.get('equality', r.get('time'))} ({'equality' if 'equality' in r else 'time'}) | {res} | "
              f"{'ok' if r.get('ok') else 'FAILED'} |")
    return 0 if all(r.get("ok") for r in rows) else 1


def main(argv: list[str]) -> int:
    stand_in = None
    if "--stand-in" in argv:
        k = argv.index("--stand-in")
        stand_in, argv = argv[k + 1], argv[:k] + argv[k + 2:]
    json_out = None
    if "--json" in argv:
        k = argv.index("--json")
        json_out, argv = argv[k + 1], argv[:k] + argv[k + 2:]
    equal = "--skip-equality" not in argv
    argv = [a for a in argv if a != "--skip-equality"]
    mode, cache, rest = argv[0], argv[1], argv[2:]
    if mode == "prepare":
        prepare(cache, stand_in)
        return 0
    if mode == "device":
        return device(cache, rest or list(VARIANTS), stand_in, json_out, equal)
    hv.pin_source(cache)
    r = equality(cache, rest[0], stand_in) if mode == "equality" else timing(cache, rest[0], stand_in)
    print(json.dumps(r), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
