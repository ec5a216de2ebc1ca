"""lorac's CPU training step at the Mamba-130M shape (fp32, 2 threads), and in the same run
the peer bench/peer_mamba.py --device cpu (HF's plain PyTorch path + PEFT) with the ratio.

    .venv/bin/python bench/bench_mamba_cpu.py [--layers 24] [--targets in_proj,x_proj,dt_proj] [--steps 3]
        [--scan-chunk L] [--peer]

One step = the compiled training graph (loss + LoRA gradients) + the compiled LoRA+ AdamW
update, as `lorac train` runs it (runtime.engine.Engine), the scan chunk `lorac train` uses
on the CPU unless --scan-chunk names one. Random weights: timing does not depend on their
values. The first step (artifact load, weight upload) is not timed. Prints one JSON line:
step_s (median), steps_s (each), tok_s, first step with compile, load average; with --peer,
then runs the peer (2 threads; 1 untimed + 2 timed steps, 15-45 min on a 2-core host), prints
its line and one with peer_s / lorac_s.
"""
from __future__ import annotations

import argparse
import os

THREADS = "2"
for var in ("TVM_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(var, THREADS)  # before numpy / TVM start their pools

import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

PEER = Path(__file__).resolve().parent / "peer_mamba.py"
MAMBA_130M = dict(model_type="mamba", vocab_size=50280, hidden_size=768, state_size=16, expand=2, conv_kernel=4,
                  num_hidden_layers=24, tie_word_embeddings=True)


def random_weights(spec, seed=0) -> dict:
    """HF-named fp32 weights of the right shapes and sane scales (A = -(1..M), dt ~ 0.01..0.1)."""
    from lorac.graphs.mamba_spec import MAMBA_TARGETS, weight_name
    rng = np.random.default_rng(seed)
    D, I, M, K = spec.hidden, spec.intermediate, spec.state, spec.conv_kernel
    f = lambda *s, scale=0.02: (scale * rng.standard_normal(s)).astype(np.float32)
    w = {"backbone.embeddings.weight": f(spec.vocab, D), "backbone.norm_f.weight": np.ones(D, np.float32)}
    for i in range(spec.layers):
        w[f"backbone.layers.{i}.norm.weight"] = np.ones(D, np.float32)
        for t in MAMBA_TARGETS:
            w[weight_name(i, f"{t}.weight")] = f(*spec.proj_shape(t))
        dt = rng.uniform(0.01, 0.1, I)
        w[weight_name(i, "dt_proj.bias")] = (dt + np.log(-np.expm1(-dt))).astype(np.float32)
        w[weight_name(i, "conv1d.weight")] = f(I, 1, K, scale=0.3)
        w[weight_name(i, "conv1d.bias")] = f(I)
        w[weight_name(i, "A_log")] = np.log(np.tile(np.arange(1, M + 1, dtype=np.float32), (I, 1)))
        w[weight_name(i, "D")] = np.ones(I, np.float32)
    return w


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--targets", default="in_proj,x_proj,dt_proj", help="LoRA targets (the peer's PEFT set)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3, help="timed steps (after one untimed)")
    ap.add_argument("--cache-dir", default=".lorac-cache")
    ap.add_argument("--scan-chunk", type=int, default=None, help="scan chunk length (default: lorac train's for cpu)")
    ap.add_argument("--peer", action="store_true", help="also run the peer (bench/peer_mamba.py --device cpu)")
    args = ap.parse_args()

    from lorac.graphs import ModelSpec, TrainSpec
    from lorac.graphs.mamba import DEVICE_CHUNK
    from lorac.runtime.engine.tvm import Engine
    from lorac.runtime.train.optim import LoraPlusConfig, group_lrs
    from lorac.runtime.train.run import init_lora

    spec = ModelSpec.from_hf_config({**MAMBA_130M, "num_hidden_layers": args.layers})
    extra = {"scan_chunk": args.scan_chunk or DEVICE_CHUNK["cpu"]}
    train = TrainSpec(batch=args.batch, seq=args.seq, lora_targets=tuple(args.targets.split(",")), rank=16, alpha=32,
                      extra=extra)
    optim = LoraPlusConfig(lr=1e-4, loraplus_ratio=16.0, total_steps=args.steps + 1)
    eng = Engine(spec, train, random_weights(spec), "cpu", "float32", args.cache_dir, optim, log=lambda m: None)
    t0 = time.perf_counter()
    rng = np.random.default_rng(0)
    zeros = {n: np.zeros(s, np.float32) for n, s in eng.shapes.items()}
    eng.set_state(init_lora(eng.shapes, rng), zeros, dict(zeros))  # compiles (or loads) the training graph
    ids = rng.integers(0, spec.vocab, (args.batch, args.seq)).astype(np.int64)
    batch = {"input_ids": ids, "labels": ids}

    def step(t):
        out = eng.step(batch, eng.lora)
        loss = out.pop("loss")
        eng.update(out, *group_lrs(t, optim), t)
        return loss

    step(1)  # also compiles the optimizer graph
    compile_s = time.perf_counter() - t0
    times, losses = [], []
    for t in range(2, args.steps + 2):
        t0 = time.perf_counter()
        losses.append(step(t))
        times.append(time.perf_counter() - t0)
    dt = float(np.median(times))
    print(json.dumps(dict(run="lorac-mamba-cpu-fp32", name="mamba-130m-shape", layers=args.layers, targets=args.targets,
                          B=args.batch, S=args.seq, threads=int(THREADS), scan_chunk=extra["scan_chunk"],
                          step_s=round(dt, 2), steps_s=[round(x, 2) for x in times],
                          tok_s=round(args.batch * args.seq / dt, 1), first_step_incl_compile_s=round(compile_s, 1),
                          loss=round(losses[-1], 4), load=[round(x, 2) for x in os.getloadavg()])), flush=True)
    if args.peer:
        r = subprocess.run([sys.executable, str(PEER), f"{args.batch}x{args.seq}", "2", "torch", "--device", "cpu",
                            "--threads", THREADS, "--layers", str(args.layers)], capture_output=True, text=True,
                           cwd=PEER.parent)
        peer = next((json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")), None)
        if peer is None:
            tail = [x for x in r.stderr.strip().splitlines() if "Warning" not in x and "falling back" not in x][-3:]
            print(json.dumps(dict(peer=PEER.name, returncode=r.returncode, error=" | ".join(tail)[-600:])), flush=True)
            return
        print(json.dumps({**peer, "load": [round(x, 2) for x in os.getloadavg()]}), flush=True)
        print(json.dumps(dict(ratio="peer_s / lorac_s", value=round(peer["step_s"] / dt, 1))), flush=True)


if __name__ == "__main__":
    main()
