"""`lorac train --target webgpu` (onnxruntime's WebGPU plugin EP, Dawn on Vulkan) on the GPU
machine: exactness against the CPU TVM backend, checkpoints across backends both ways, the
README's default run, and the step's speed against lorac's CUDA step and torch eager + PEFT.

Here (the dev venv; pip and apt reach their registries):
    .venv/bin/python bench/webgpu_step.py prepare [DIR]        (DIR: .devcarry/webgpu)
        DIR/whl     cp312 wheels: onnxruntime, onnxruntime-ep-webgpu, onnx, onnx-ir, protobuf, flatbuffers
        DIR/vulkan  Debian's libvulkan1 unpacked with dpkg -x (the Vulkan loader, libvulkan.so.1)
        DIR/work    a tiny random Qwen3 and its corpus (tests/tiny_model.py)
        DIR/ref     the CPU TVM backend's 20-step run of it (metrics, checkpoints at 10 and 20)
There (from the repo root; bench/h200_env.sh first where the lorac CUDA column is wanted):
    source bench/webgpu_env.sh [DIR]
    python3 bench/webgpu_step.py device OUT [--dir DIR] [--cuda-cache C] [--peers] [--cpu-ep] [--profile]
        [--cases 40m-8x1024,q06-8x1024] [--steps 10] [--smollm2 FILE.gguf] [--no-exact]
Here again, with OUT brought back:
    .venv/bin/python bench/webgpu_step.py resume OUT [DIR]    the WebGPU run's step-10 checkpoint on TVM CPU

`device` prints JSON lines and a table: the 20-step losses of `lorac train --target webgpu`
against the CPU TVM run's (fp32: 1e-4 relative is the bar), the run resumed on WebGPU from the
TVM checkpoint, the onnxruntime CPU provider on the same machine, where each graph's nodes ran
(onnxruntime's node placement), and per case the full step (training graph, LoRA+ AdamW, the
loss read back; fp32 on WebGPU) against lorac CUDA (bf16, bench/h200_vs_peers.py `lorac`, from
a cache `h200_vs_peers.py prepare` made) and torch eager + PEFT (bf16, bench/peer_lora_gpu.py),
with the ratios; --cpu-ep adds onnxruntime's CPU provider at the 40M case (the issue's ">= 10x
the CPU EP"), --profile onnxruntime's per-op profile of the WebGPU step (top op types).
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
DIR = REPO / ".devcarry" / "webgpu"
WHEELS = ["onnxruntime==1.32.0", "onnxruntime-ep-webgpu==0.4.0", "onnx==1.23.2", "onnx-ir==1.1.0",
          "protobuf>=4.25.8", "flatbuffers", "gguf==0.19.0"]  # gguf: the default run's model
# the exactness run: every backend trains the same 20 steps of the tiny model (fp32)
EXACT = ["--steps", "20", "--batch", "4", "--seq", "64", "--lr", "2e-3", "--eval-every", "10", "--save-every", "10",
         "--eval-batches", "2", "--sample-tokens", "0", "--progress", "lines", "--seed", "0"]
QWEN3_40M = dict(model_type="qwen3", vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                 num_attention_heads=8, num_key_value_heads=4, head_dim=64, tie_word_embeddings=True)
QWEN3_06B = dict(model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True, rope_theta=1e6)
QWEN3_TINY = dict(model_type="qwen3", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)
CASES = {"40m-8x1024": (QWEN3_40M, "qwen3-40m", 8, 1024), "q06-8x1024": (QWEN3_06B, "qwen3-0.6b", 8, 1024),
         "40m-4x256": (QWEN3_40M, "qwen3-40m", 4, 256),
         "tiny-2x32": (QWEN3_TINY, None, 2, 32), "tiny-1x64": (QWEN3_TINY, None, 1, 64)}  # the benches' tests


def lorac(*args: str, stand_in: bool = False, **kw) -> subprocess.CompletedProcess:
    """`lorac ARGS` in a child process without torch; stand_in: the CPU standing in for the WebGPU
    adapter (tests/webgpu_stand_in.py: no GPU needed)."""
    code = "import sys; sys.modules['torch'] = None; "
    if stand_in:
        code += f"sys.path.insert(0, {str(REPO / 'tests')!r}); import webgpu_stand_in; webgpu_stand_in.install(); "
    code += "from lorac.runtime.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, **kw)


def curve(out: Path) -> dict:
    """{(step, "loss" | "eval_loss"): value} of OUT/metrics.jsonl."""
    recs = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return {(r["step"], k): r[k] for r in recs for k in ("loss", "eval_loss") if k in r}


def compare(name: str, got: dict, ref: dict, since: int = 0, tol: float = 1e-4) -> dict:
    """`got`'s losses and eval losses after step `since` against `ref`'s, relative."""
    ref = {k: v for k, v in ref.items() if k[0] > since}
    keys = [k for k in got if k in ref]
    rel = max((abs(got[k] - ref[k]) / max(abs(ref[k]), 1e-12) for k in keys), default=float("nan"))
    return {"check": name, "points": len(keys), "missing": len([k for k in ref if k not in got]),
            "max_rel_diff": float(f"{rel:.3g}"), "tol": tol, "ok": bool(keys) and rel <= tol,
            "losses": [round(got[(s, "loss")], 6) for s in range(since + 1, since + 4) if (s, "loss") in got]}


def emit(rec: dict) -> dict:
    print(json.dumps(rec), flush=True)
    return rec


GL_DEBS = ("libvulkan1", "libglvnd0", "libglx0", "libegl1", "libopengl0", "libgl1", "libgles2")


# -- here --------------------------------------------------------------------------------
def prepare_runtime(d: Path) -> None:
    """DIR/whl, DIR/debs, DIR/vulkan: what runs onnxruntime's WebGPU plugin there (no model)."""
    d.mkdir(parents=True, exist_ok=True)
    whl = d / "whl"
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--platform", "manylinux_2_28_x86_64", "--platform",
                    "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64", "-d", str(whl), *WHEELS], check=True)
    # the Vulkan loader and glvnd, as Debian ships them: NVIDIA's Vulkan driver (libGLX_nvidia) needs
    # libGLdispatch from libglvnd0, else "Could not get vkCreateInstance ... for ICD libGLX_nvidia.so.0"
    # and Dawn finds no adapter (seen on the H200); webgpu_env.sh unpacks them into / there
    debs = d / "debs"
    shutil.rmtree(debs, ignore_errors=True)
    debs.mkdir()
    subprocess.run(["apt-get", "download", *GL_DEBS], cwd=debs, check=True, capture_output=True)
    shutil.rmtree(d / "vulkan", ignore_errors=True)
    for deb in sorted(debs.glob("*.deb")):
        subprocess.run(["dpkg", "-x", str(deb), str(d / "vulkan")], check=True)
    shutil.rmtree(d / "vulkan" / "usr" / "share", ignore_errors=True)


def prepare(d: Path) -> None:
    prepare_runtime(d)
    whl = d / "whl"
    sys.path.insert(0, str(REPO / "tests"))
    from tiny_model import make_workdir
    work = make_workdir(d / "work")
    ref = d / "ref" / "tvm"
    shutil.rmtree(ref, ignore_errors=True)
    cache = Path(tempfile.gettempdir()) / "lorac-webgpu-bench-cache"
    r = lorac("train", "--model", str(work / "model"), "--data", str(work / "corpus.txt"), "--out", str(ref),
              "--backend", "tvm", "--target", "cpu", "--cache-dir", str(cache), *EXACT)
    if r.returncode:
        sys.exit(r.stderr[-3000:])
    print(json.dumps({"prepared": str(d), "wheels": sorted(p.name for p in whl.iterdir()),
                      "ref_losses": [round(v, 6) for k, v in sorted(curve(ref).items()) if k[1] == "loss"][:3],
                      "bytes": sum(p.stat().st_size for p in d.rglob("*") if p.is_file())}))


def resume_here(out: Path, d: Path) -> None:
    """The WebGPU run's step-10 checkpoint resumed by the CPU TVM backend: steps 11-20 equal
    the reference's (and the WebGPU run's own)."""
    work, ref = d / "work", curve(d / "ref" / "tvm")
    ckpt = out / "exact-webgpu" / "checkpoints" / "ckpt-000010"
    with tempfile.TemporaryDirectory() as tmp:
        r = lorac("train", "--model", str(work / "model"), "--data", str(work / "corpus.txt"), "--out", tmp,
                  "--backend", "tvm", "--target", "cpu", "--resume", str(ckpt), *EXACT,
                  "--cache-dir", str(Path(tempfile.gettempdir()) / "lorac-webgpu-bench-cache"))
        if r.returncode:
            sys.exit(r.stderr[-3000:])
        got = curve(Path(tmp))
    emit(compare("webgpu ckpt 10 -> tvm cpu, steps 11-20 vs the tvm run", got, ref, since=10))
    emit(compare("webgpu ckpt 10 -> tvm cpu, steps 11-20 vs the webgpu run", got, curve(out / "exact-webgpu"),
                 since=10))


# -- there -------------------------------------------------------------------------------
def probe() -> dict:
    import onnxruntime as ort
    import onnxruntime_ep_webgpu
    from lorac.runtime.engine import ort_webgpu
    ort_webgpu.register(ort)
    devs = [dict(ep=d.ep_name, type=str(d.device.type), vendor=d.device.vendor, vendor_id=hex(d.device.vendor_id),
                 metadata=dict(d.device.metadata), ep_metadata=dict(d.ep_metadata)) for d in ort.get_ep_devices()]
    out = {"onnxruntime": ort.__version__, "plugin": getattr(onnxruntime_ep_webgpu, "__version__", "0.4.0?"),
           "ep_devices": devs}
    dev = ort_webgpu.choose(ort.get_ep_devices())
    if dev is not None:
        for kind in ("DEFAULT", "HOST_ACCESSIBLE"):
            try:
                info = dev.memory_info(getattr(ort.OrtDeviceMemoryType, kind))
                out[f"memory_info_{kind}"] = None if info is None else f"{info.name} id {info.device_id}"
            except Exception as e:  # noqa: BLE001
                out[f"memory_info_{kind}"] = f"error: {e}"
        try:
            from onnxruntime.capi import _pybind_state as C
            out["kernel_defs"] = len(C.get_registered_ep_kernel_defs(ort_webgpu.EP))
        except Exception as e:  # noqa: BLE001
            out["kernel_defs"] = f"error: {e}"
        out["residency"] = residency_probe(ort, dev)
    return out


def residency_probe(ort, dev) -> dict:
    """Both of DeviceValues' allocators on the device: values up, an Add run on them through IO
    binding into a device output, the result back; each route's outcome."""
    from types import SimpleNamespace

    from onnx import TensorProto, helper
    from lorac.runtime.engine.ort import DeviceValues
    g = helper.make_graph([helper.make_node("Add", ["a", "b"], ["c"])], "probe",
                          [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1024]) for n in "ab"],
                          [helper.make_tensor_value_info("c", TensorProto.FLOAT, [1024])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=9).SerializeToString()

    def session():
        so = ort.SessionOptions()
        so.add_provider_for_devices([dev], {})
        return ort.InferenceSession(model, so)
    a, b = np.arange(1024, dtype=np.float32), np.full(1024, 0.5, np.float32)
    out = {}
    for route, entry in (("memory_info", dev), ("session_allocator", SimpleNamespace(memory_info=lambda kind: None))):
        try:
            vals = DeviceValues(ort, entry, session=session)
            up = vals.put({"a": a, "b": b})
            c = vals.empty((1024,))
            s = session()
            io = s.io_binding()
            io.bind_ortvalue_input("a", up["a"])
            io.bind_ortvalue_input("b", up["b"])
            io.bind_ortvalue_output("c", c)
            s.run_with_iobinding(io)
            got = vals.read([c])[0]
            out[route] = {"ok": bool(np.array_equal(got, a + b)), "how": vals.how, "device": c.device_name(),
                          "providers": s.get_providers()}
        except Exception as e:  # noqa: BLE001
            out[route] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    return out


def placement_lines(stderr: str) -> list[str]:
    return [x for x in stderr.splitlines() if " graph (" in x and "ready on" in x]


def exactness(out: Path, d: Path, smollm2: str | None) -> list[dict]:
    work, ref = d / "work", curve(d / "ref" / "tvm")
    common = ["--model", str(work / "model"), "--data", str(work / "corpus.txt"), *EXACT]
    rows = []
    for name, extra in (("exact-webgpu", ["--target", "webgpu"]),
                        ("exact-ort-cpu", ["--backend", "ort"]),
                        ("tvm-then-webgpu", ["--target", "webgpu", "--resume",
                                             str(d / "ref" / "tvm" / "checkpoints" / "ckpt-000010")])):
        t0 = time.perf_counter()
        r = lorac("train", *common, "--out", str(out / name), *extra)
        if r.returncode:
            rows.append(emit({"check": name, "error": (r.stderr.strip().splitlines() or ["?"])[-1][:500]}))
            continue
        rec = compare(f"{name} vs tvm cpu", curve(out / name), ref, since=10 if "then" in name else 0)
        rec["wall_s"] = round(time.perf_counter() - t0, 1)
        rec["placement"] = placement_lines(r.stderr)
        summary = json.loads((out / name / "summary.json").read_text())
        rec["device"] = summary.get("device")
        rows.append(emit(rec))
    if smollm2:  # the README's default run, on WebGPU
        t0 = time.perf_counter()
        r = lorac("train", "--model", smollm2, "--target", "webgpu", "--out", str(out / "default"), "--progress",
                  "lines")
        (out / "default.log").write_text(r.stderr)
        rec = {"check": "default run --target webgpu", "rc": r.returncode, "wall_s": round(time.perf_counter() - t0, 1)}
        if r.returncode == 0:
            s = json.loads((out / "default" / "summary.json").read_text())
            steps = [json.loads(x) for x in (out / "default" / "metrics.jsonl").read_text().splitlines()]
            rec.update(eval_before=s["eval_loss_before"], eval_after=s["eval_loss_after"],
                       step_s_median=float(np.median([x["step_s"] for x in steps if "step_s" in x][2:])),
                       sample_adapted=s.get("sample_adapted"), placement=placement_lines(r.stderr))
        else:
            rec["error"] = (r.stderr.strip().splitlines() or ["?"])[-1][:500]
        rows.append(emit(rec))
    return rows


def gpu_used_gb() -> float | None:
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=30)
        return round(float(r.stdout.split()[0]) / 1024, 2)
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


def setup_case(name: str, provider: str = "webgpu", profile: str | None = None, checkpointing: bool = False,
               rewrite=None, adamw: bool = True):
    """A case's OrtEngine on onnxruntime (`provider`: webgpu or cpu) with random frozen weights, the
    LoRA and zero moments set, and four random batches -> SimpleNamespace(eng, spec, optim, batches,
    B, S, chunk, setup_s, gpu_before). rewrite: applied to the training graph as it is emitted;
    adamw: the optimizer's session made too."""
    sys.modules["torch"] = None
    from types import SimpleNamespace

    from lorac.graphs import ModelSpec, TrainSpec
    from lorac.graphs.families import for_spec
    from lorac.graphs.ops.loss import auto_chunk
    from lorac.runtime.engine.ort import OrtEngine
    from lorac.runtime.train.optim import LoraPlusConfig
    from lorac.runtime.train.run import init_lora

    cfg, _, B, S = CASES[name]
    spec = ModelSpec.from_hf_config(cfg)
    chunk = auto_chunk(spec.vocab, B * S, 1 << 29)  # `lorac train --target webgpu`'s default
    train = TrainSpec(batch=B, seq=S, lora_targets=for_spec(spec).TARGETS, rank=16, alpha=32, loss_chunk=chunk,
                      checkpointing=checkpointing)
    optim = LoraPlusConfig(lr=1e-4, loraplus_ratio=16.0, warmup_steps=0, total_steps=100)
    base = gpu_used_gb()
    t0 = time.perf_counter()
    target = "webgpu" if provider == "webgpu" else "cpu"
    eng = OrtEngine(spec, train, {}, target, optim_cfg=optim, log=lambda m: print(m, file=sys.stderr, flush=True),
                    profile=profile)
    if rewrite is not None:
        recipe = eng._recipe
        eng._recipe = lambda kind: ((lambda: rewrite(recipe(kind)[0]())), *recipe(kind)[1:]) if kind == "train" \
            else recipe(kind)
    s = eng.compile("train")  # its inputs name the frozen weights: random ones, tiled from one block
    block = (0.02 * np.random.default_rng(0).standard_normal(1 << 20)).astype(np.float32)
    weights = {}
    for i in s.sess.get_inputs():
        if i.name in ("input_ids", "labels") or i.name.endswith((".param", ".grad")):
            continue
        n = int(np.prod(i.shape))
        weights[i.name] = (np.ones(n, np.float32) if "norm" in i.name else np.resize(block, n)).reshape(i.shape)
    eng._host_weights = weights  # what the engine would have been given (uploaded at the first step)
    if adamw:
        eng.compile("adamw")
    zeros = {n: np.zeros(sh, np.float32) for n, sh in eng.shapes.items()}
    eng.set_state(init_lora(eng.shapes, np.random.default_rng(1)), zeros, dict(zeros))
    batches = [np.random.default_rng(2 + i).integers(0, spec.vocab, (B, S)).astype(np.int64) for i in range(4)]
    return SimpleNamespace(eng=eng, spec=spec, optim=optim, batches=batches, B=B, S=S, chunk=chunk,
                           setup_s=time.perf_counter() - t0, gpu_before=base)


def full_step(c, t: int, keep: dict | None = None) -> float:
    """What `lorac train` runs each step (training graph, LoRA+ AdamW, the loss read back) -> loss;
    keep: gets the step's flat LoRA gradients (host copies)."""
    from lorac.runtime.train.optim import group_lrs
    out = c.eng.step({"input_ids": c.batches[t % 4], "labels": c.batches[t % 4]}, c.eng.lora, read_loss=False)
    loss = out.pop("loss")
    if keep is not None:
        keep.update(c.eng.host(out))
    c.eng.update(out, *group_lrs(t, c.optim), t)
    return float(loss.numpy())


def case(name: str, provider: str, steps: int, profile: str | None, checkpointing: bool) -> dict:
    """One case's full steps in this process on onnxruntime (`provider`: webgpu or cpu)."""
    c = setup_case(name, provider, profile, checkpointing)
    eng = c.eng
    times, losses = [], []
    for t in range(1, steps + 4):
        t1 = time.perf_counter()
        losses.append(round(full_step(c, t), 5))
        times.append(time.perf_counter() - t1)
    step_s = float(np.median(times[3:])) if len(times) > 3 else float(np.median(times))
    rec = dict(case=name, provider=provider, dtype="float32", B=c.B, S=c.S, loss_chunk=c.chunk,
               checkpointing=checkpointing, step_ms=round(step_s * 1e3, 2), tok_s=round(c.B * c.S / step_s),
               first_step_s=round(times[0], 2), setup_s=round(c.setup_s, 1), losses=losses[:3] + losses[-2:],
               gpu_used_gb=gpu_used_gb(), gpu_used_before_gb=c.gpu_before, **placement(eng))
    if eng.adapter:
        rec["adapter"] = eng.adapter
    if profile:
        rec["profile"] = top_ops(eng.end_profiling())
    return rec


def placement(eng) -> dict:
    """{placement: {graph: {provider: nodes}}, off_main: {graph: op types not on the first provider}}."""
    return dict(placement={k: {ep: sum(c.values()) for ep, c in v.items()} for k, v in eng.placement.items()},
                off_main={k: sorted(set().union(*[set(c) for ep, c in v.items() if ep != eng.providers[0]]))
                          for k, v in eng.placement.items()})


def top_ops(files: list[str], n: int = 15) -> dict:
    """Total ms per (event category, op type) over onnxruntime profile traces, the top n."""
    totals: dict = {}
    for f in files:
        for ev in json.loads(Path(f).read_text()):
            if ev.get("ph") != "X" or ev.get("cat") not in ("Node", "Kernel", "Api"):
                continue
            op = ev.get("args", {}).get("op_name") or ev.get("name", "?").split("_")[0]
            key = f"{ev['cat']}:{ev.get('args', {}).get('provider', '')}:{op}"
            totals[key] = totals.get(key, 0.0) + ev.get("dur", 0) / 1e3
    top = sorted(totals.items(), key=lambda kv: -kv[1])[:n]
    return {"files": files, "top_ms": {k: round(v, 1) for k, v in top}}


def json_lines(text: str) -> list[dict]:
    sys.path.insert(0, str(HERE))
    from h200_vs_peers import _json_lines  # the JSON lines of a child's output, as the CUDA bench reads them
    return _json_lines(text)


def sub(cmd: list[str], timeout: int, env: dict | None = None) -> list[dict]:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return [{"error": f"timeout after {timeout} s: {' '.join(cmd[1:4])}"}]
    got = json_lines(r.stdout)
    return got or [{"error": (r.stderr.strip().splitlines() or ["?"])[-1][:500]}]


def device(args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    smi = shutil.which("nvidia-smi")
    gpu = subprocess.run([smi, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip() if smi else None
    emit({"probe": probe(), "gpu": gpu, "VK_DRIVER_FILES": os.environ.get("VK_DRIVER_FILES")})
    if not args.no_exact:
        exactness(out, Path(args.dir), args.smollm2)
    rows = []
    for name in args.cases.split(","):
        _, peer_model, B, S = CASES[name]
        me = [sys.executable, __file__, "case", name, "--steps", str(args.steps)] + \
            (["--checkpointing"] if args.checkpointing else [])
        web = sub(me + (["--profile", str(out / f"prof-{name}")] if args.profile else []), 1200)[0]
        if "error" in web and not args.checkpointing:  # out of memory? the same case with checkpointing
            web = {**sub(me + ["--checkpointing"], 1200)[0], "first_try": web["error"]}
        web.setdefault("case", name)
        emit({"webgpu": web})
        row = {"case": name, "webgpu": web}
        if args.cpu_ep and name.startswith("40m"):
            row["cpu_ep"] = emit({"cpu_ep": sub([sys.executable, __file__, "case", name, "--provider", "cpu",
                                                 "--steps", "1"], 3000)[0]})["cpu_ep"]
        if args.cuda_cache:
            row["cuda"] = emit({"cuda": sub([sys.executable, str(HERE / "h200_vs_peers.py"), "lorac", args.cuda_cache,
                                             name], 900)[0]})["cuda"]
        if args.peers:
            row["eager"] = emit({"eager": sub([sys.executable, str(HERE / "peer_lora_gpu.py"), peer_model, f"{B}x{S}",
                                               "eager"], 900)[0]})["eager"]
        rows.append(row)
    ms = lambda r, k: (r.get(k) or {}).get("step_ms")
    ratio = lambda a, b: round(a / b, 2) if a and b else "-"
    print("\n| case | WebGPU fp32 ms | tok/s | lorac CUDA bf16 ms | torch eager+PEFT bf16 ms | WebGPU / CUDA | "
          "WebGPU / eager | CPU EP ms | CPU EP / WebGPU |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        w = ms(r, "webgpu")
        print(f"| {r['case']} | {w or r['webgpu'].get('error', '-')} | {r['webgpu'].get('tok_s', '-')} | "
              f"{ms(r, 'cuda') or '-'} | {ms(r, 'eager') or '-'} | {ratio(w, ms(r, 'cuda'))} | "
              f"{ratio(w, ms(r, 'eager'))} | {ms(r, 'cpu_ep') or '-'} | {ratio(ms(r, 'cpu_ep'), w)} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sp = ap.add_subparsers(dest="mode", required=True)
    p = sp.add_parser("prepare")
    p.add_argument("dir", nargs="?", default=str(DIR))
    p = sp.add_parser("resume")
    p.add_argument("out")
    p.add_argument("dir", nargs="?", default=str(DIR))
    p = sp.add_parser("device")
    p.add_argument("out")
    p.add_argument("--dir", default=str(DIR))
    p.add_argument("--cases", default="40m-8x1024,q06-8x1024")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--cuda-cache", help="a cache `bench/h200_vs_peers.py prepare C 40m-8x1024 q06-8x1024` made")
    p.add_argument("--peers", action="store_true", help="torch eager + PEFT (bench/peer_lora_gpu.py)")
    p.add_argument("--cpu-ep", action="store_true", help="onnxruntime's CPU provider at the 40M cases")
    p.add_argument("--profile", action="store_true", help="onnxruntime's profile of the WebGPU steps")
    p.add_argument("--checkpointing", action="store_true", help="(case) recompute layers in the backward")
    p.add_argument("--smollm2", help="the SmolLM2-135M GGUF: the README's default run with --target webgpu")
    p.add_argument("--no-exact", action="store_true", help="only the speed cases (a second call)")
    p = sp.add_parser("case")
    p.add_argument("name", choices=sorted(CASES))
    p.add_argument("--provider", choices=("webgpu", "cpu"), default="webgpu")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--profile")
    p.add_argument("--checkpointing", action="store_true")
    args = ap.parse_args()
    if args.mode == "prepare":
        prepare(Path(args.dir))
    elif args.mode == "resume":
        resume_here(Path(args.out), Path(args.dir))
    elif args.mode == "device":
        device(args)
    else:
        print(json.dumps(case(args.name, args.provider, args.steps, args.profile, args.checkpointing)), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
