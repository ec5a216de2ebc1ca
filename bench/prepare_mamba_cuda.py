"""Compile the Mamba-130M-shape training graph for CUDA (no GPU needed here), for an H200 run.

    .venv/bin/python bench/prepare_mamba_cuda.py OUT_DIR [--dtypes bfloat16,float32] [--targets in_proj,x_proj,dt_proj]

Writes OUT_DIR/mamba130m-<dtype>-<B>x<S>/ (a lorac artifact: library + manifest.json) per
dtype and prints one JSON line per build (nodes, emit and compile seconds). The shape is
bench/bench_mamba_cpu.py's (hidden 768, 24 layers, state 16, expand 2, conv 4, vocab 50280,
tied), LoRA r=16 on the peer's PEFT targets by default, 8x1024 tokens, scan chunk 4.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from lorac.compiler import compile_graph
from lorac.graphs import ModelSpec, TrainSpec, build_training_graph

from bench_mamba_cpu import MAMBA_130M


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--targets", default="in_proj,x_proj,dt_proj")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=24)
    args = ap.parse_args()
    spec = ModelSpec.from_hf_config({**MAMBA_130M, "num_hidden_layers": args.layers})
    train = TrainSpec(batch=args.batch, seq=args.seq, lora_targets=tuple(args.targets.split(",")), rank=16, alpha=32)
    for dtype in args.dtypes.split(","):
        t0 = time.perf_counter()
        graph = build_training_graph(spec, train)
        emit_s = time.perf_counter() - t0
        out = args.out / f"mamba130m-{dtype}-{args.batch}x{args.seq}"
        t0 = time.perf_counter()
        compile_graph(graph, target="cuda", out_dir=out, dtype=dtype)
        print(json.dumps(dict(artifact=str(out), layers=args.layers, targets=args.targets, nodes=len(graph.graph.node),
                              emit_s=round(emit_s, 1), compile_s=round(time.perf_counter() - t0, 1))), flush=True)


if __name__ == "__main__":
    main()
