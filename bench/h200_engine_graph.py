"""The training loop's step (runtime.engine.Engine: training graph + LoRA+ AdamW, as `lorac
train` runs it) with and without CUDA graphs, on the same weights and batches.

    .venv/bin/python bench/h200_engine_graph.py prepare CACHE        # here: compile (no GPU)
    python3 bench/h200_engine_graph.py device CACHE [STEPS]         # GPU machine, runtime-only TVM

Cases: the 40M Qwen3 at 8x1024 and the Qwen3-0.6B shape at 1x512 and 8x1024, bf16, LoRA r=16
on all seven targets. Prints per case and mode the ms per step (optimizer included, after
3 untimed steps) and the largest relative difference of the graph run's losses from the
plain run's (same kernels, so they should agree to rounding).
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

QWEN3_40M = dict(model_type="qwen3", vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                 num_attention_heads=8, num_key_value_heads=4, head_dim=64, tie_word_embeddings=True)
QWEN3_06B = dict(model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True, rope_theta=1e6)
CASES = [("40m", QWEN3_40M, 8, 1024), ("q06", QWEN3_06B, 1, 512), ("q06", QWEN3_06B, 8, 1024)]


def _engine(cfg, B, S, cache, cuda_graph, weights=None):
    from lorac.graphs import ALL_TARGETS, ModelSpec, TrainSpec
    from lorac.runtime.engine.tvm import Engine
    from lorac.runtime.train.optim import LoraPlusConfig

    spec = ModelSpec.from_hf_config(cfg)
    train = TrainSpec(batch=B, seq=S, lora_targets=tuple(ALL_TARGETS), rank=16, alpha=32)
    optim = LoraPlusConfig(lr=1e-4, loraplus_ratio=16.0, total_steps=100)
    return Engine(spec, train, weights or {}, "cuda", "bfloat16", cache, optim, log=lambda m: None,
                  cuda_graph=cuda_graph), spec, optim


def prepare(cache: str) -> None:
    for name, cfg, B, S in CASES:
        for graph in (False, True):
            eng, _, _ = _engine(cfg, B, S, cache, graph)
            for kind in ("train", "adamw"):
                print(name, B, S, "graph" if graph else "plain", kind, eng.compile(kind), flush=True)


def device(cache: str, steps: int) -> None:
    sys.modules["torch"] = None  # the runtime must not need torch
    from lorac.runtime.engine.artifact import read_manifest
    from lorac.runtime.train.optim import group_lrs
    from lorac.runtime.train.run import init_lora

    for name, cfg, B, S in CASES:
        losses, res = {}, {"case": f"{name}-{B}x{S}"}
        for graph in (False, True):
            m = read_manifest(_engine(cfg, B, S, cache, graph)[0].compile("train"))  # a cache hit: input names
            rng = np.random.default_rng(0)
            weights = {i["name"]: (0.02 * rng.standard_normal(i["shape"])).astype(np.float32) if "norm" not in i["name"]
                       else np.ones(i["shape"], np.float32)
                       for i in m["inputs"] if i["name"] not in ("input_ids", "labels") and ".lora_" not in i["name"]}
            eng, spec, optim = _engine(cfg, B, S, cache, graph, weights=weights)
            zeros = {n: np.zeros(s, np.float32) for n, s in eng.shapes.items()}
            eng.set_state(init_lora(eng.shapes, np.random.default_rng(1)), zeros, dict(zeros))
            brng = np.random.default_rng(2)
            batches = [brng.integers(0, spec.vocab, (B, S)).astype(np.int64) for _ in range(4)]
            seq, times = [], []
            for t in range(1, steps + 1):
                ids = batches[t % len(batches)]
                t0 = time.perf_counter()
                out = eng.step({"input_ids": ids, "labels": ids}, eng.lora)  # the loss read syncs
                loss = out.pop("loss")
                eng.update(out, *group_lrs(t, optim), t)  # grad_norm read syncs
                times.append(time.perf_counter() - t0)
                seq.append(loss)
            mode = "graph" if graph else "plain"
            losses[mode] = np.array(seq)
            res[f"{mode}_ms"] = round(float(np.mean(times[3:])) * 1e3, 2)
            res[f"{mode}_bound_inputs"] = eng._artifact("train").bound_inputs
            del eng
        res["loss_first_last"] = [round(float(losses["plain"][0]), 5), round(float(losses["plain"][-1]), 5)]
        res["max_rel_loss_diff"] = float(np.max(np.abs(losses["graph"] - losses["plain"]) / np.abs(losses["plain"])))
        res["speedup"] = round(res["plain_ms"] / res["graph_ms"], 2)
        print(json.dumps(res), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "prepare":
        prepare(sys.argv[2])
    else:
        device(sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 12)
