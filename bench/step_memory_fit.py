"""How close `--checkpointing auto`'s memory estimate (runtime/train/memory.py) comes to the
static plans the CUDA compiler makes, at the benchmark shapes (build machine, no GPU).

    .venv/bin/python bench/step_memory_fit.py CACHE CASE [CASE ...]

CASE is MODEL:BATCH:SEQ:LAYERS:CHECKPOINTING:KEEP[:LOSS_CHUNK], MODEL one of 8b, 06b, 40m
(bench/h200_vs_peers.py's shapes), phi3, mamba; LAYERS overrides the model's depth (the plan
is linear in the layers: 2 and 4 give the per-layer terms in seconds); LOSS_CHUNK defaults to
`lorac train`'s CUDA default. Compiles each training step as `lorac train --target cuda`
does (bf16, CUDA graphs, flat LoRA buffers) into CACHE and prints one JSON line per case:
the plan, the estimate of the plan alone (no weights, no LoRA state) and their ratio.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from h200_vs_peers import LLAMA3_8B, MAMBA_130M, QWEN3_06B, QWEN3_40M  # noqa: E402

PHI3_MINI = dict(model_type="phi3", vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=32, tie_word_embeddings=False)
MODELS = {"8b": LLAMA3_8B, "06b": QWEN3_06B, "40m": QWEN3_40M, "phi3": PHI3_MINI, "mamba": MAMBA_130M}


def fit(cache: str, case: str) -> dict:
    from lorac.graphs import ModelSpec, TrainSpec
    from lorac.graphs.families import for_spec
    from lorac.graphs.ops.loss import auto_chunk
    from lorac.runtime.engine.tvm import Engine
    from lorac.runtime.train.optim import LoraPlusConfig
    from lorac.runtime.train.memory import plan_bytes

    name, B, S, L, ckpt, keep, *chunk = case.split(":")
    B, S = int(B), int(S)
    spec = ModelSpec.from_hf_config({**MODELS[name], "num_hidden_layers": int(L)})
    fam = for_spec(spec)
    train = TrainSpec(batch=B, seq=S, lora_targets=fam.TARGETS, rank=16, alpha=32, checkpointing=ckpt == "1",
                      keep_layers=int(keep), loss_chunk=int(chunk[0]) if chunk else auto_chunk(spec.vocab, B * S),
                      extra=fam.train_extra("cuda", 0))
    eng = Engine(spec, train, {}, "cuda", "bfloat16", cache, LoraPlusConfig(), log=lambda m: None)
    t = time.perf_counter()
    art = eng.compile("train")
    plan = json.loads((art / "manifest.json").read_text())["memory"]["static_plan_bytes"]
    est = plan_bytes(spec, train)
    return dict(case=case, plan_gb=round(plan / 1e9, 3), estimate_gb=round(est / 1e9, 3),
                ratio=round(est / plan, 3), compile_s=round(time.perf_counter() - t, 1))


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    for c in sys.argv[2:]:
        print(json.dumps(fit(sys.argv[1], c)), flush=True)
