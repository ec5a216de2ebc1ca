"""What `lorac train --memory-budget GB` plans for a QLoRA base with dense vs quantized embeddings
(`--quantize-embeddings`): no GPU, no weights, the model's HF config alone.

    .venv/bin/python bench/qlora_embed_estimate.py [--budgets 8,10,48] [--shapes 1x2048,4x2048]

For the Llama-3-8B and Llama-3-70B shapes (bench/h200_vs_peers.py's configs; every linear
projection NF4 with double-quantized absmax, as `--quantize nf4` and the *-bnb-4bit checkpoints;
LoRA r=16 on all seven targets; bf16 on cuda, its default loss chunk) this runs the plan `lorac
train --target cuda --memory-budget GB` makes (runtime/train/plan.py plan_run, the same code)
under each --quantize-embeddings value and prints one JSON line per case: the setting chosen
(checkpointing, layers kept, offload), the estimate (runtime/train/memory.py: static plan +
frozen weights + LoRA state + dequantization workspace; the budget is GB less 1 GiB of library
workspaces), the frozen bytes, and the embeddings' bytes; then the estimate's change against
dense embeddings for the same setting.

The estimate is not the device memory in use: the H200 measured 8.17 GB in use where the
dense-embedding 8B 1x2048 NF4 `--memory-budget 8` estimate is printed here (1x2048 auto8), and
48.15 GB for 70B 1x2048 NF4 all offloaded (docs/BENCHMARKS.md); the difference between a
dense and a quantized line at the same setting is what quantizing the tables should save.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from h200_vs_peers import LLAMA3_70B, LLAMA3_8B  # noqa: E402 - the shapes the H200 cases use

MODELS = {"llama3-8b": LLAMA3_8B, "llama3-70b": LLAMA3_70B}


def base_sizes(spec, quant) -> tuple[int, int]:
    """train/memory.frozen_sizes of the loaded base: dense elements (embeddings, norms, head) and
    the bytes of the projections' NF4 blocks and scales."""
    import numpy as np

    from lorac.graphs.ops.quant import quant_inputs
    D, L, q, kv = spec.hidden, spec.layers, spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
    dense = spec.vocab * D * (1 if spec.tied else 2) + L * 2 * D + D  # tables, two norms a layer, the final norm
    packed = 0
    for name, qt in quant:
        out, inp = spec.proj_shape(name.split(".")[-2])
        packed += sum(int(np.prod(shape)) * np.dtype(dt).itemsize for _, shape, dt in quant_inputs(qt, name, out, inp))
    return dense, packed


def plan_case(config: dict, batch: int, seq: int, budget: float, embeddings: str, host: str = "auto") -> dict:
    from lorac.graphs import ModelSpec
    from lorac.graphs.families import for_spec
    from lorac.graphs.ops.quant import Quant
    from lorac.runtime.config import TrainConfig
    from lorac.runtime.model.quant.embeddings import table_bytes
    from lorac.runtime.train import memory
    from lorac.runtime.train.plan import plan_run
    spec = ModelSpec.from_hf_config(config)
    fam = for_spec(spec)
    quant = tuple(sorted((fam.weight_name(i, t), Quant("nf4", 64, True)) for i in range(spec.layers) for t in fam.TARGETS))
    frozen = base_sizes(spec, quant)
    cfg = TrainConfig(target="cuda", batch=batch, seq=seq, rank=16, alpha=32.0, memory_budget=budget,
                      quantize_embeddings=embeddings, offload_embeddings=host)
    lines = []
    plan = plan_run(cfg, spec, config, frozen, quant=quant, log=lines.append)
    t = plan.train
    from lorac.runtime.model.quant.embeddings import frozen_with
    n_weights, packed = frozen_with(spec, frozen, quant, t.quant)
    n_weights, packed = memory.frozen_on_device(spec, (n_weights, packed), t.quant, plan.cfg.offload_embeddings == "on")
    need = memory.estimate(spec, t, n_weights, "bfloat16", packed)
    return {"case": f"{batch}x{seq}", "budget_gb": budget, "embeddings": embeddings,
            "resolved": plan.cfg.quantize_embeddings, "input_table_on_host": plan.cfg.offload_embeddings == "on",
            "checkpointing": plan.cfg.checkpointing,
            "keep_layers": t.keep_layers, "loss_chunk": t.loss_chunk, "estimate_gb": round(need / 1e9, 3),
            "fits": need <= int(budget * 1e9) - memory.WORKSPACE,
            "frozen_dense_gb": round(2 * n_weights / 1e9, 3), "frozen_quantized_gb": round(packed / 1e9, 3),
            "embeddings_quantized_gb": round(table_bytes(spec, t.quant) / 1e9, 3),
            "dequant_workspace_gb": round(memory.dequant_workspace(spec, t, "bfloat16") / 1e9, 3),
            "log": [l for l in lines if l.startswith(("memory:", "embeddings:"))]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budgets", default="8,10,48", help="GB, comma-separated (--memory-budget)")
    ap.add_argument("--shapes", default="1x2048,4x2048", help="BxS, comma-separated")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--offload-embeddings", default="auto", choices=("auto", "on", "off"),
                    help="as lorac train's: the input table in host memory (auto: where the step checkpoints)")
    args = ap.parse_args(argv)
    for model in args.models.split(","):
        for shape in args.shapes.split(","):
            b, s = (int(x) for x in shape.split("x"))
            for budget in (float(x) for x in args.budgets.split(",")):
                rows = {e: plan_case(MODELS[model], b, s, budget, e, args.offload_embeddings)
                        for e in ("off", "nf4", "int8", "auto")}
                for e, row in rows.items():
                    print(json.dumps({"model": model, **row}), flush=True)
                dense = rows["off"]
                same = [e for e in ("nf4", "int8") if (rows[e]["checkpointing"], rows[e]["keep_layers"]) ==
                        (dense["checkpointing"], dense["keep_layers"])]
                print(json.dumps({"model": model, "case": shape, "budget_gb": budget, "summary": {
                    e: {"saves_gb_at_the_same_setting": round(dense["estimate_gb"] - rows[e]["estimate_gb"], 3)}
                    for e in same} | {"auto_picks": rows["auto"]["resolved"]}}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
