"""Resident memory of a CPU training run over a quantized GGUF, its blocks kept against dense.

Usage:
  python bench/gguf_resident.py [--model FILE.gguf] [--steps 4] [--batch 4] [--seq 128] [--threads 2]
                                [--cache-dir .lorac-cache/bench] [--modes keep,dequantize]
  python bench/gguf_resident.py --kernels [--threads 2]   # the dequantization kernels alone

Without --model it trains the bundled SmolLM2-135M-Instruct re-quantized as llama.cpp's
Q4_K_M would (bench/q4_k_m.py writes it once to /tmp/lorac-bench/SmolLM2-135M-Q4_K_M.gguf).
Per mode (`--quantized-base keep`, `--quantized-base dequantize`) a first process compiles the
train and AdamW graphs into the cache (the compiler's memory is not the run's), then a fresh
process loads the model as `lorac train` does (runtime/train/run.Run), trains `--steps` steps
on the same batches and prints one JSON line: peak resident memory (VmHWM), its anonymous and
file-backed parts at the end, the bytes of frozen weights the engine holds (its device tensors:
dense, and quantized blocks), the compiled step's static plan, the median step time (wall and
process CPU time: on a loaded host CPU time is the steadier) and the losses. A last line compares the modes: the losses' largest relative difference and the ratio
of peak resident memory.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

WORKER = Path(__file__).resolve()


def status() -> dict:
    """This process's /proc status lines in MB: VmHWM (peak resident), VmRSS, RssAnon, RssFile."""
    out = {}
    for line in open("/proc/self/status"):
        key, _, rest = line.partition(":")
        if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
            out[key] = round(int(rest.split()[0]) / 1024, 1)
    return out


def engine_frozen_bytes(eng) -> dict:
    """Bytes of the frozen weights the engine holds, split into quantized blocks and dense tensors."""
    import numpy as np
    from lorac.core.dtypes import as_dtype
    dense = quant = 0
    for name, t in eng._weights.items():
        n = int(np.prod(t.shape)) * as_dtype(str(t.dtype)).itemsize
        if name.endswith((".weight", ".bias")):
            dense += n
        else:
            quant += n
    return {"dense_mb": round(dense / 2**20, 1), "quantized_mb": round(quant / 2**20, 1)}


def worker(args) -> dict:
    import numpy as np
    from lorac.runtime.config import TrainConfig
    from lorac.runtime.train.optim import group_lrs
    from lorac.runtime.train.run import Run
    cfg = TrainConfig(model=args.model, quantized_base=args.mode, steps=args.steps, batch=args.batch, seq=args.seq,
                      eval_batches=0, sample_tokens=0, cache_dir=args.cache_dir, out=f"/tmp/lorac-bench/out-{args.mode}")
    before = status()
    t0 = time.perf_counter()
    run = Run(cfg, log=lambda m: None)
    eng = run.engine
    if args.compile:
        for kind in ("train", "adamw"):
            eng.compile(kind)
        return {"mode": args.mode, "compiled_s": round(time.perf_counter() - t0, 1)}
    st = run.fresh_state()
    eng.set_state(st["lora"], st["m"], st["v"])  # loads the train artifact, uploads the weights
    loaded = status()
    t_load = time.perf_counter() - t0
    batches = run.data.batches(cfg.batch, seed=0)
    losses, times, cpu = [], [], []
    for t in range(1, args.steps + 1):
        b = next(batches)
        t1, c1 = time.perf_counter(), time.process_time()
        out = eng.step(b, eng.lora)
        losses.append(out.pop("loss"))
        eng.update(out, *group_lrs(t, run.optim_cfg), t)
        times.append(time.perf_counter() - t1)
        cpu.append(time.process_time() - c1)
    step = eng._artifact("train")
    return {"mode": args.mode, "model": args.model, "load_s": round(t_load, 1),
            "step_s_median": round(float(np.median(times)), 3), "step_s": [round(x, 3) for x in times],
            "step_cpu_s_median": round(float(np.median(cpu)), 3), "load_avg": os.getloadavg()[0],
            "losses": [float(x) for x in losses], "engine_frozen": engine_frozen_bytes(eng),
            "static_plan_mb": round(step.manifest.static_plan_bytes / 2**20, 1),
            "mb_before_load": before, "mb_after_load": loaded, "mb_end": status()}


KERNELS = [("Q5_0", 1536, 576), ("Q8_0", 1536, 576), ("Q4_1", 1536, 576), ("Q4_K", 576, 1536), ("Q6_K", 576, 1536)]


def kernels(args) -> None:
    """ns per value of each GGUF type's dequantization compiled alone for the CPU (SmolLM2's
    gate_proj and down_proj shapes; the dense output written), best of 30 calls after 3."""
    import numpy as np
    from lorac.compiler import compile_graph
    from lorac.graphs.builder import GraphBuilder
    from lorac.graphs.ops.quant import Quant, declare
    from lorac.runtime.engine.artifact import load_artifact
    from lorac.runtime.model.quant.gguf_blocks import quantize
    rng = np.random.default_rng(0)
    for kind, out, inp in KERNELS:
        g = GraphBuilder("dequant")
        g.output(declare(g, Quant(kind), "w", out, inp).dense(g), "w.dense")
        step = load_artifact(compile_graph(g.finish(), target="cpu", out_dir=Path(args.cache_dir) / f"dequant-{kind}"), "cpu")
        blocks = quantize((0.02 * rng.standard_normal((out, inp))).astype(np.float32), kind)
        feeds = {f"w.{kind}": step.upload(step.input_spec(f"w.{kind}"), blocks)}
        times = []
        for i in range(33):
            t = time.perf_counter()
            step(feeds, as_numpy=False)
            times.append(time.perf_counter() - t)
        best = min(times[3:])
        print(json.dumps({"kind": kind, "shape": [out, inp], "threads": args.threads, "best_ms": round(best * 1e3, 3),
                          "ns_per_value": round(best / (out * inp) * 1e9, 2), "load_avg": os.getloadavg()[0]}), flush=True)


def spawn(args, mode: str, compile_: bool) -> dict:
    cmd = [sys.executable, str(WORKER), "--worker", "--mode", mode, "--model", args.model, "--steps", str(args.steps),
           "--batch", str(args.batch), "--seq", str(args.seq), "--cache-dir", args.cache_dir]
    env = dict(os.environ, TVM_NUM_THREADS=str(args.threads), OMP_NUM_THREADS=str(args.threads),
               OPENBLAS_NUM_THREADS=str(args.threads))
    r = subprocess.run(cmd + (["--compile"] if compile_ else []), capture_output=True, text=True, env=env)
    if r.returncode:
        sys.exit(f"{mode} worker failed:\n{r.stderr[-4000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cache-dir", default=".lorac-cache/bench")
    p.add_argument("--modes", default="keep,dequantize")
    p.add_argument("--kernels", action="store_true", help="time each GGUF type's dequantization kernel alone")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--compile", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(args)), flush=True)
        return
    if args.kernels:  # this process: TVM reads TVM_NUM_THREADS when it starts its pool
        if os.environ.get("TVM_NUM_THREADS") != str(args.threads):
            os.execve(sys.executable, [sys.executable, *sys.argv],
                      dict(os.environ, TVM_NUM_THREADS=str(args.threads), OPENBLAS_NUM_THREADS=str(args.threads)))
        kernels(args)
        return
    if not args.model:
        from q4_k_m import smollm2_q4_k_m
        args.model = str(smollm2_q4_k_m(Path("/tmp/lorac-bench")))
    modes = args.modes.split(",")
    results = {}
    for mode in modes:
        print(json.dumps(spawn(args, mode, compile_=True)), flush=True)
    for mode in modes:
        results[mode] = spawn(args, mode, compile_=False)
        print(json.dumps(results[mode]), flush=True)
    if {"keep", "dequantize"} <= set(results):
        k, d = results["keep"], results["dequantize"]
        rel = max(abs(a - b) / abs(b) for a, b in zip(k["losses"], d["losses"]))
        print(json.dumps({"loss_max_rel_diff": rel, "peak_rss_keep_over_dequantize":
                          round(k["mb_end"]["VmHWM"] / d["mb_end"]["VmHWM"], 3),
                          "step_keep_over_dequantize": round(k["step_s_median"] / d["step_s_median"], 3),
                          "step_cpu_keep_over_dequantize": round(k["step_cpu_s_median"] / d["step_cpu_s_median"], 3)}))


if __name__ == "__main__":
    main()
