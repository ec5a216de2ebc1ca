"""The CPU training step of both lorac backends and of PyTorch+PEFT, in one run.

    .venv/bin/python bench/bench_backends_cpu.py [--cases 40m,smollm2] [--rounds 2] [--steps 4] [--threads 2]
                                                 [--backends tvm,ort,torch]

One step = forward + backward + LoRA+ AdamW (r=16, alpha 32, all seven targets), fp32, 4x256
tokens, random weights and ids, `--threads` threads everywhere:
- tvm: lorac's Engine (compiled artifacts, GEMMs on OpenBLAS or MKL per shape), step + update;
- ort: lorac's OrtEngine (the same ONNX graphs on onnxruntime's CPU provider, IO binding);
- torch: transformers' model + PEFT LoRA + torch.optim.AdamW (LoRA+ groups), eager.
Each measurement is a fresh process (so no thread pool of one spins beside another), in
rounds tvm, ort, torch, tvm, ort, torch, ...: a busy host slows neighbours alike. Prints a
JSON line per measurement and one summary line per case (medians over rounds of each
process's fastest step, and the ratios).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CASES = {  # HF config.json fields: lorac's ModelSpec and transformers read the same dict
    "40m": dict(model_type="qwen3", vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                num_attention_heads=8, num_key_value_heads=4, head_dim=64, tie_word_embeddings=True),
    "smollm2": dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                    tie_word_embeddings=True, rope_theta=100000.0),
}
B, S, RANK, ALPHA, LR, RATIO = 4, 256, 16, 32.0, 1e-4, 16.0
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _ids(vocab: int):
    import numpy as np
    return np.random.default_rng(0).integers(0, vocab, (B, S)).astype(np.int64)


def _timed(step, steps: int) -> list[float]:
    step(1)  # warm-up: first-touch allocations, thread pools
    out = []
    for t in range(2, steps + 2):
        t0 = time.perf_counter()
        step(t)
        out.append(time.perf_counter() - t0)
    return out


def lorac_step(backend: str, case: str, steps: int, threads: int, cache: str) -> dict:
    sys.modules["torch"] = None  # TVM's FFI would import it: lorac never needs it
    import numpy as np

    from lorac.graphs import ModelSpec, TrainSpec, build_training_graph
    from lorac.runtime.engine.tvm import Engine
    from lorac.runtime.engine.ort import OrtEngine
    from lorac.runtime.train.optim import LoraPlusConfig
    from lorac.runtime.train.run import init_lora

    spec = ModelSpec.from_hf_config(CASES[case])
    train = TrainSpec(batch=B, seq=S, rank=RANK, alpha=ALPHA, lora_targets=TARGETS)
    rng = np.random.default_rng(0)
    weights = {}
    for i in build_training_graph(spec, train).graph.input:  # the frozen weights the graph takes
        shape = [d.dim_value for d in i.type.tensor_type.shape.dim]
        if i.name not in ("input_ids", "labels") and ".lora_" not in i.name:
            weights[i.name] = (np.ones(shape) if "norm" in i.name else 0.02 * rng.standard_normal(shape)).astype(np.float32)
    optim = LoraPlusConfig(lr=LR, loraplus_ratio=RATIO, total_steps=1000)
    t0 = time.perf_counter()
    if backend == "ort":
        eng = OrtEngine(spec, train, weights, "cpu", optim_cfg=optim, log=lambda m: None, threads=threads)
    else:
        eng = Engine(spec, train, weights, "cpu", cache_dir=cache, optim_cfg=optim, log=lambda m: None)
    for kind in ("train", "adamw"):
        eng.compile(kind)
    zeros = {n: np.zeros(s, np.float32) for n, s in eng.shapes.items()}
    eng.set_state(init_lora(eng.shapes, np.random.default_rng(1)), zeros, dict(zeros))
    ids = _ids(spec.vocab)
    losses = []

    def step(t):
        out = eng.step({"input_ids": ids, "labels": ids}, eng.lora)
        losses.append(out.pop("loss"))
        eng.update(out, LR, LR * RATIO, t)

    times = _timed(step, steps)
    return {"setup_s": round(time.perf_counter() - t0 - sum(times), 1), "losses": [round(x, 6) for x in losses[:3]],
            "times": times}


def torch_step(case: str, steps: int, threads: int) -> dict:
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    torch.set_num_threads(threads)
    cfg = dict(CASES[case])
    arch = cfg.pop("model_type")
    conf, model_cls = {"qwen3": ("Qwen3Config", "Qwen3ForCausalLM"), "llama": ("LlamaConfig", "LlamaForCausalLM")}[arch]
    model = getattr(transformers, model_cls)(getattr(transformers, conf)(**cfg)).float()
    model = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=list(TARGETS)))
    groups = [[p for n, p in model.named_parameters() if p.requires_grad and f"lora_{g}" in n] for g in "AB"]
    opt = torch.optim.AdamW([{"params": groups[0], "lr": LR}, {"params": groups[1], "lr": LR * RATIO}],
                            weight_decay=0.0)
    ids = torch.from_numpy(_ids(cfg["vocab_size"]))

    def step(t):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()

    return {"times": _timed(step, steps), "torch": torch.__version__}


def worker(args) -> None:
    if args.worker == "torch":
        r = torch_step(args.cases, args.steps, args.threads)
    else:
        r = lorac_step(args.worker, args.cases, args.steps, args.threads, args.cache)
    times = r.pop("times")
    print(json.dumps({"who": args.worker, "case": args.cases, "threads": args.threads,
                      "step_s_min": round(min(times), 3), "step_s_median": round(statistics.median(times), 3), **r}),
          flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4, help="timed steps per process (after one warm-up step)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache", default=".lorac-cache/bench")
    ap.add_argument("--backends", default="tvm,ort,torch", help="which to run, in this order each round")
    ap.add_argument("--worker", choices=("tvm", "ort", "torch"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    env = {**os.environ, "TVM_NUM_THREADS": str(args.threads)}
    for case in args.cases.split(","):
        best: dict = {who: [] for who in args.backends.split(",")}
        for _ in range(args.rounds):
            for who in best:
                r = subprocess.run([sys.executable, __file__, "--worker", who, "--cases", case, "--steps",
                                    str(args.steps), "--threads", str(args.threads), "--cache", args.cache],
                                   env=env, capture_output=True, text=True)
                if r.returncode != 0:
                    sys.exit(f"{who} {case} failed:\n{r.stderr[-3000:]}")
                line = r.stdout.strip().splitlines()[-1]
                print(line[:-1] + f', "load": {os.getloadavg()[0]:.2f}}}', flush=True)
                best[who].append(json.loads(line)["step_s_min"])
        med = {who: statistics.median(v) for who, v in best.items()}
        ratios = {f"{a}_over_{b}": round(med[a] / med[b], 2) for a, b in (("torch", "tvm"), ("torch", "ort"), ("ort", "tvm"))
                  if a in med and b in med}
        print(json.dumps({"case": case, "B": B, "S": S, "rounds": args.rounds,
                          **{f"{w}_s": round(v, 3) for w, v in med.items()}, **ratios}), flush=True)


if __name__ == "__main__":
    main()
