"""Wall time of the whole `lorac compile` command on the Qwen3-0.6B-shape training graph.

    .venv/bin/python bench/bench_compile.py [--targets cpu,cuda] [--repeat 2] [--work DIR]

Writes the 8x1024 training graph (28 layers, LoRA r=16 on all seven targets) to
WORK/q06.onnx, then for each target runs `lorac compile ... --force` REPEAT times and once
more without --force (a cached rebuild), each as its own process, so process start and
imports count as they do for a user. Prints one JSON line per run with the manifest's
import / build / export split. Issue #3's targets: <= 10 s, and <= 1 s for the cached rebuild.
The cuda build needs nvcc here (no GPU).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from lorac.graphs import ALL_TARGETS, ModelSpec, TrainSpec, build_training_graph

QWEN3_06B = dict(model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                 num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                 tie_word_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6)


def run_compile(graph: Path, target: str, out: Path, force: bool) -> dict:
    lorac = Path(sys.executable).with_name("lorac")
    cmd = [str(lorac), "compile", str(graph), "--target", target, "--out", str(out), "-q"]
    if force:
        cmd.append("--force")
    t = time.perf_counter()
    subprocess.run(cmd, check=True)
    wall = time.perf_counter() - t
    manifest = json.loads((out / "manifest.json").read_text())
    return {"target": target, "force": force, "wall_s": round(wall, 2),
            "inside": manifest["compile_seconds"] if force else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--targets", default="cpu,cuda")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--work", default=".lorac-cache/bench-compile")
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    graph = work / "q06.onnx"
    model = build_training_graph(ModelSpec.from_hf_config(QWEN3_06B),
                                 TrainSpec(batch=8, seq=1024, lora_targets=ALL_TARGETS, rank=16, alpha=32))
    graph.write_bytes(model.SerializeToString())
    for target in args.targets.split(","):
        out = work / f"q06-{target}"
        for _ in range(args.repeat):
            print(json.dumps({"nodes": len(model.graph.node), **run_compile(graph, target, out, True)}), flush=True)
        print(json.dumps(run_compile(graph, target, out, False)), flush=True)


if __name__ == "__main__":
    main()
