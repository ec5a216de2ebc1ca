"""lorac CPU artifact step time vs onnxruntime on the same ONNX training graph.

    TVM_NUM_THREADS=2 .venv/bin/python bench/bench_cpu_step.py [--steps 5] [--cases 40m,smollm2]

fp32, batch 4 x 256 tokens, LoRA r=16 on all seven targets; one step = loss + every LoRA
gradient (no optimizer). Both run with 2 threads. Prints one JSON line per case and run.
For the PyTorch+PEFT peer in the same run, with the optimizer step on every side, use
bench/bench_backends_cpu.py (docs/BENCHMARKS.md).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from h200_check import device_inputs  # noqa: E402 - the same deterministic inputs

from lorac.compiler import compile_graph  # noqa: E402
from lorac.graphs import ALL_TARGETS, ModelSpec, TrainSpec, build_training_graph  # noqa: E402
from lorac.runtime.engine.artifact import load_artifact  # noqa: E402
from lorac.runtime.devices.cpu.blas import blas_info  # noqa: E402

CASES = {
    "qwen3-40m": dict(arch="qwen3", vocab=32000, hidden=512, layers=8, heads=8, kv_heads=4, head_dim=64,
                      intermediate=1408, qk_norm=True),
    "smollm2-135m-shape": dict(arch="llama", vocab=49152, hidden=576, layers=30, heads=9, kv_heads=3, head_dim=64,
                               intermediate=1536, rope_theta=100000.0),
}


def time_calls(fn, steps: int) -> list[float]:
    fn()  # warm-up (first-touch allocations, thread pools)
    out = []
    for _ in range(steps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache", default=".lorac-cache/bench")
    args = ap.parse_args()
    os.environ.setdefault("TVM_NUM_THREADS", str(args.threads))
    import onnxruntime as ort

    for name in args.cases.split(","):
        spec = ModelSpec(**CASES[name])
        train = TrainSpec(batch=4, seq=256, rank=16, alpha=32, lora_targets=tuple(ALL_TARGETS))
        graph = build_training_graph(spec, train)
        t = time.perf_counter()
        art = compile_graph(graph, target="cpu", out_dir=Path(args.cache) / f"{name}-cpu")
        compile_s = time.perf_counter() - t
        step = load_artifact(art, "cpu")
        inputs, dev_args = device_inputs(step)
        lorac_t = time_calls(lambda: step(dev_args, as_numpy=False), args.steps)

        so = ort.SessionOptions()
        so.intra_op_num_threads = args.threads
        so.inter_op_num_threads = 1
        sess = ort.InferenceSession(graph.SerializeToString(), so, providers=["CPUExecutionProvider"])
        ort_t = time_calls(lambda: sess.run(None, inputs), args.steps)
        ref = sess.run(None, inputs)
        got = step(inputs)
        err = max(float(np.abs(g - r).max() / max(np.abs(r).max(), 1e-30)) for g, r in zip(got.values(), ref))
        tokens = train.batch * train.seq
        print(json.dumps({
            "case": name, "B": train.batch, "S": train.seq, "threads": args.threads,
            "lorac_step_s_min": round(min(lorac_t), 3), "lorac_step_s_median": round(statistics.median(lorac_t), 3),
            "ort_step_s_min": round(min(ort_t), 3), "ort_step_s_median": round(statistics.median(ort_t), 3),
            "lorac_tok_s": round(tokens / min(lorac_t), 1), "ort_over_lorac": round(min(ort_t) / min(lorac_t), 2),
            "max_rel_diff_vs_ort": err, "compile_s": round(compile_s, 2), "blas": blas_info(),
        }), flush=True)
        del step, sess


if __name__ == "__main__":
    main()
