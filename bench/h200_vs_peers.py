"""lorac's full training step against torch + PEFT, in one GPU-machine call, with the ratio table.

    .venv/bin/python bench/h200_vs_peers.py prepare CACHE [CASE ...]   # here: compile (no GPU)
    python3 bench/h200_vs_peers.py device CACHE [CASE ...]             # GPU machine, runtime-only TVM
        (PEER_TIMEOUT=seconds for each case's peers, default 420; NO_PEERS=1 runs lorac alone)

Mamba cases (mamba*: HF Mamba shapes, LoRA on in/x/dt_proj as the PEFT peer, activation
checkpointing, the scan on lorac's CUDA kernels) run their peers through
bench/peer_mamba.py, one process per mode: `torch` (transformers' PyTorch path) and
`mamba_ssm` (its CUDA kernels, where bench/h200_build_mamba_ssm.sh built them).

A lorac step is what `lorac train` runs each step: the compiled training step (loss and every
LoRA gradient, CUDA graphs, cuDNN attention), the loss read back to the host, then the LoRA+
AdamW update with clipping (engine.update; its grad-norm read syncs again). Each case runs in
a process of its own (lorac without torch), then its peers (bench/peer_lora_gpu.py), so the
GPU memory figures are per run: lorac's is the device memory in use after the steps minus what
the process held before loading anything (TVM's pool keeps the step's peak); the peers' is
torch's peak allocated (and reserved) and, for the fast peers (run through bench/peer_in_use.py),
the same measure as lorac's: in use after the steps less the bare context. MFU = model FLOPs /
step time / 790 TFLOP/s (the bf16 GEMM rate measured on this H200 class), with FLOPs = 4 x
matmul parameters x tokens (forward and input-gradient GEMMs; LoRA has no weight gradients)
+ 6 x L x B x S^2 x H x Dh (causal attention, forward and backward).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).parent
QWEN3_40M = dict(model_type="qwen3", vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                 num_attention_heads=8, num_key_value_heads=4, head_dim=64, tie_word_embeddings=True)
QWEN3_06B = dict(model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True, rope_theta=1e6)
MAMBA_130M = dict(model_type="mamba", vocab_size=50280, hidden_size=768, state_size=16, expand=2, conv_kernel=4,
                  num_hidden_layers=24, tie_word_embeddings=True)
MAMBA_370M = {**MAMBA_130M, "hidden_size": 1024, "num_hidden_layers": 48}  # state-spaces/mamba-370m-hf
MAMBA_790M = {**MAMBA_130M, "hidden_size": 1536, "num_hidden_layers": 48}  # state-spaces/mamba-790m-hf
MAMBA_PEER_TARGETS = ("in_proj", "x_proj", "dt_proj")  # what the PEFT peer trains on HF's Mamba
LLAMA3_8B = dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
                 rope_theta=500000.0)
LLAMA3_70B = {**LLAMA3_8B, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
              "num_attention_heads": 64}
# name: (config, peer model name, B, S, lorac TrainSpec extras, peer modes); extras "quant": every
# linear projection's weight quantized so (graphs/ops/quant.py; random blocks), "memory_budget": what
# --checkpointing auto picks for `lorac train --memory-budget GB`; a peer mode "fast:MODE" runs
# shared/bench/peer_fast_gpu.py's MODE (Unsloth; copy it next to this script or set PEER_FAST)
CASES = {
    "q06-8x1024": (QWEN3_06B, "qwen3-0.6b", 8, 1024, {"loss_chunk": 2048}, ["compile"]),
    "q06-1x512": (QWEN3_06B, "qwen3-0.6b", 1, 512, {}, ["reduce-overhead"]),
    "40m-8x1024": (QWEN3_40M, "qwen3-40m", 8, 1024, {}, ["compile"]),
    "8b-4x2048": (LLAMA3_8B, "llama3-8b", 4, 2048, {"checkpointing": True, "loss_chunk": 2048},
                  ["compile", "eager-gc"]),
    "8b-4x2048-full": (LLAMA3_8B, "llama3-8b", 4, 2048, {"loss_chunk": 2048}, []),  # no checkpointing
    "8b-4x2048-keep20": (LLAMA3_8B, "llama3-8b", 4, 2048, {"checkpointing": True, "keep_layers": 20, "loss_chunk": 2048},
                         ["compile"]),  # the top 20 layers keep their activations: <= 40 GB
    "8b-4x2048-keep22": (LLAMA3_8B, "llama3-8b", 4, 2048, {"checkpointing": True, "keep_layers": 22, "loss_chunk": 2048},
                         []),
    "8b-4x2048-keep32": (LLAMA3_8B, "llama3-8b", 4, 2048, {"checkpointing": True, "keep_layers": 32, "loss_chunk": 2048},
                         []),  # nothing recomputed but the lean saved set (graphs/decoder.py Saved)
    # 1024-token loss chunks: half the logits buffers of 2048 (0.5 GB), room for one more kept layer
    "8b-4x2048-keep26": (LLAMA3_8B, "llama3-8b", 4, 2048, {"checkpointing": True, "keep_layers": 26, "loss_chunk": 1024},
                         []),
    "8b-4x2048-keep27": (LLAMA3_8B, "llama3-8b", 4, 2048, {"checkpointing": True, "keep_layers": 27, "loss_chunk": 1024},
                         ["compile"]),  # <= 40 GB
    "8b-4x2048-keep28": (LLAMA3_8B, "llama3-8b", 4, 2048, {"checkpointing": True, "keep_layers": 28, "loss_chunk": 512},
                         []),  # 512-token loss chunks: 0.26 GB less than 1024, room for one more kept layer
    # `lorac train --memory-budget 40`: the setting --checkpointing auto picks (runtime/train/memory.py)
    "8b-4x2048-auto40": (LLAMA3_8B, "llama3-8b", 4, 2048, {"memory_budget": 40.0}, ["compile"]),
    # QLoRA: an NF4 base (bitsandbytes' layout, double-quantized absmax) against Unsloth's 4-bit run
    "8b-4x2048-nf4-auto10": (LLAMA3_8B, "llama3-8b", 4, 2048, {"quant": "nf4", "memory_budget": 10.0},
                             ["fast:unsloth-4bit-gc"]),
    "8b-1x2048-nf4-auto8": (LLAMA3_8B, "llama3-8b", 1, 2048, {"quant": "nf4", "memory_budget": 8.0},
                            ["fast:unsloth-4bit-gc"]),
    "8b-4x2048-nf4-full": (LLAMA3_8B, "llama3-8b", 4, 2048, {"quant": "nf4", "checkpointing": True, "loss_chunk": 1024},
                           []),
    "8b-4x2048-nf4-offload": (LLAMA3_8B, "llama3-8b", 4, 2048, {"quant": "nf4", "checkpointing": True, "offload": True,
                                                                 "loss_chunk": 1024}, []),
    # bf16 base, every layer recomputed, inputs offloaded: against Unsloth's offloaded checkpointing
    "8b-4x2048-offload": (LLAMA3_8B, "llama3-8b", 4, 2048, {"checkpointing": True, "offload": True, "loss_chunk": 1024},
                          ["fast:unsloth-gc"]),
    # the same with 512-token loss chunks: ~0.26 GB less logits buffers than 1024, under Unsloth's 19.1 GB
    "8b-4x2048-offload-lc512": (LLAMA3_8B, "llama3-8b", 4, 2048, {"checkpointing": True, "offload": True,
                                                                  "loss_chunk": 512}, ["fast:unsloth-gc"]),
    # the same with the inputs alone offloaded (--offload-state off; the default sends the attention state too)
    "8b-4x2048-offload-lc512-nostate": (LLAMA3_8B, "llama3-8b", 4, 2048, {"checkpointing": True, "offload": True,
                                                                          "offload_state": False, "loss_chunk": 512},
                                        ["fast:unsloth-gc"]),
    # the same with the input embedding in pinned host memory (--offload-embeddings on): 1.05 GB off the GPU
    "8b-4x2048-offload-lc512-eh": (LLAMA3_8B, "llama3-8b", 4, 2048, {"checkpointing": True, "offload": True,
                                                                     "loss_chunk": 512, "embed_host": True},
                                   ["fast:unsloth-gc"]),
    # what --memory-budget 20 picked before --keep-mlp and smaller loss chunks (every layer recomputed, inputs
    # and attention state offloaded, 2048-token chunks): auto20-eh's baseline on the same machine
    "8b-4x2048-offload-eh": (LLAMA3_8B, "llama3-8b", 4, 2048, {"checkpointing": True, "offload": True,
                                                               "loss_chunk": 2048, "embed_host": True},
                             ["fast:unsloth-gc"]),
    # what --memory-budget 20 picks over a bf16 base (with the attention state every layer recomputed does
    # not fit: the offloaded inputs alone, runtime/train/memory.py choose)
    "8b-4x2048-auto20": (LLAMA3_8B, "llama3-8b", 4, 2048, {"memory_budget": 20.0}, ["fast:unsloth-gc"]),
    # ... and with the input embedding in host memory, as `lorac train --memory-budget 20` now holds it
    "8b-4x2048-auto20-eh": (LLAMA3_8B, "llama3-8b", 4, 2048, {"memory_budget": 20.0, "embed_host": True},
                            ["fast:unsloth-gc"]),
    # auto20-eh's pick with one more MLP half kept (0.47 GB): what fits under Unsloth bf16's 19.8 GB in use
    "8b-4x2048-keep1-mlp2-eh": (LLAMA3_8B, "llama3-8b", 4, 2048, {"checkpointing": True, "offload": True,
                                                                  "keep_layers": 1, "keep_mlp": 2, "loss_chunk": 1024,
                                                                  "embed_host": True}, ["fast:unsloth-gc"]),
    # the same a little below Unsloth bf16's 19.8 GB in use (the estimate leaves ~0.9 GB of a bf16 step out)
    "8b-4x2048-auto19.5-eh": (LLAMA3_8B, "llama3-8b", 4, 2048, {"memory_budget": 19.5, "embed_host": True},
                              ["fast:unsloth-gc"]),
    # no 70B peer: its random bf16 checkpoint (140 GB) fits neither the GPU machine's disk nor its GPU
    "70b-1x2048-nf4-auto48": (LLAMA3_70B, "llama3-70b", 1, 2048, {"quant": "nf4", "memory_budget": 48.0}, []),
    # every layer recomputed, inputs offloaded: the leanest setting (auto48's estimate, 46.8 GB, is at its budget)
    "70b-1x2048-nf4-offload": (LLAMA3_70B, "llama3-70b", 1, 2048, {"quant": "nf4", "checkpointing": True,
                                                                   "offload": True, "loss_chunk": 1024}, []),
    # quantized embeddings (--quantize-embeddings nf4: the input embedding and the LM head in NF4, a plain
    # absmax; the head read in vocabulary slices): "embed" beside "quant"
    "8b-1x2048-nf4e-auto8": (LLAMA3_8B, "llama3-8b", 1, 2048, {"quant": "nf4", "embed": "nf4", "memory_budget": 8.0},
                             ["fast:unsloth-4bit-gc"]),
    "8b-1x2048-nf4e-offload": (LLAMA3_8B, "llama3-8b", 1, 2048, {"quant": "nf4", "embed": "nf4", "checkpointing": True,
                                                                 "offload": True}, []),
    "8b-1x2048-nf4e-auto8-nostate": (LLAMA3_8B, "llama3-8b", 1, 2048, {"quant": "nf4", "embed": "nf4",
                                                                      "memory_budget": 8.0, "offload_state": False},
                                     ["fast:unsloth-4bit-gc"]),
    "8b-4x2048-nf4e-auto10": (LLAMA3_8B, "llama3-8b", 4, 2048, {"quant": "nf4", "embed": "nf4", "memory_budget": 10.0},
                              ["fast:unsloth-4bit-gc"]),
    # the input table (dense, or NF4 with the head) in host memory: what `--memory-budget 10` then keeps
    "8b-4x2048-nf4-auto10-eh": (LLAMA3_8B, "llama3-8b", 4, 2048, {"quant": "nf4", "memory_budget": 10.0,
                                                                  "embed_host": True}, ["fast:unsloth-4bit-gc"]),
    "8b-4x2048-nf4e-auto10-eh": (LLAMA3_8B, "llama3-8b", 4, 2048, {"quant": "nf4", "embed": "nf4", "memory_budget": 10.0,
                                                                   "embed_host": True}, ["fast:unsloth-4bit-gc"]),
    "8b-1x2048-nf4-auto8-eh": (LLAMA3_8B, "llama3-8b", 1, 2048, {"quant": "nf4", "memory_budget": 8.0, "embed_host": True},
                               ["fast:unsloth-4bit-gc"]),
    "8b-1x2048-nf4e-auto8-eh": (LLAMA3_8B, "llama3-8b", 1, 2048, {"quant": "nf4", "embed": "nf4", "memory_budget": 8.0,
                                                                  "embed_host": True}, ["fast:unsloth-4bit-gc"]),
    # the same keeping one layer more than auto picks for 10 GB (--keep-layers 3 --checkpointing offload)
    "8b-4x2048-nf4e-keep3": (LLAMA3_8B, "llama3-8b", 4, 2048, {"quant": "nf4", "embed": "nf4", "checkpointing": True,
                                                               "keep_layers": 3, "offload": True},
                             ["fast:unsloth-4bit-gc"]),
    # the same with the recomputed layers' inputs alone offloaded (--offload-state off)
    "8b-4x2048-nf4e-auto10-nostate": (LLAMA3_8B, "llama3-8b", 4, 2048, {"quant": "nf4", "embed": "nf4",
                                                                        "memory_budget": 10.0, "offload_state": False},
                                      ["fast:unsloth-4bit-gc"]),
    # a 16 GB and a 24 GB card: what the memory beyond Unsloth's buys (more layers kept, fewer recomputed)
    "8b-4x2048-nf4e-auto16": (LLAMA3_8B, "llama3-8b", 4, 2048, {"quant": "nf4", "embed": "nf4", "memory_budget": 16.0},
                              []),
    "8b-4x2048-nf4e-auto24": (LLAMA3_8B, "llama3-8b", 4, 2048, {"quant": "nf4", "embed": "nf4", "memory_budget": 24.0},
                              []),
    "70b-1x2048-nf4e-offload": (LLAMA3_70B, "llama3-70b", 1, 2048, {"quant": "nf4", "embed": "nf4", "checkpointing": True,
                                                                     "offload": True, "loss_chunk": 1024}, []),
    "70b-1x2048-nf4e-offload-nostate": (LLAMA3_70B, "llama3-70b", 1, 2048, {"quant": "nf4", "embed": "nf4",
                                                                             "checkpointing": True, "offload": True,
                                                                             "offload_state": False, "loss_chunk": 1024},
                                        []),
    "70b-1x2048-nf4e-auto48": (LLAMA3_70B, "llama3-70b", 1, 2048, {"quant": "nf4", "embed": "nf4", "memory_budget": 48.0},
                               []),
    "q06-1x16384": (QWEN3_06B, "qwen3-0.6b", 1, 16384, {"checkpointing": True, "loss_chunk": 2048},
                    ["eager-gc", "compile"]),
    "mamba130m-8x1024": (MAMBA_130M, "mamba", 8, 1024, {"checkpointing": True}, ["torch", "mamba_ssm"]),
    "mamba370m-8x2048": (MAMBA_370M, "mamba", 8, 2048, {"checkpointing": True}, []),
    "mamba790m-8x2048": (MAMBA_790M, "mamba", 8, 2048, {"checkpointing": True}, []),
}
PEAK = 790e12


def _engine(case: str, cache: str, weights=None, tune: int = 0, target: str = "cuda"):
    from lorac.graphs import ModelSpec, TrainSpec
    from lorac.graphs.families import for_spec
    from lorac.graphs.ops.loss import auto_chunk
    from lorac.runtime.engine.tvm import Engine
    from lorac.runtime.train.optim import LoraPlusConfig

    cfg, _, B, S, extra, _ = CASES[case]
    spec = ModelSpec.from_hf_config(cfg)
    fam = for_spec(spec)
    kw = {"loss_chunk": auto_chunk(spec.vocab, B * S), **extra}  # `lorac train`'s CUDA default
    budget, on_host = kw.pop("memory_budget", None), kw.pop("embed_host", False)
    kind, embed = kw.pop("quant", None), kw.pop("embed", None)
    if kind:
        from lorac.graphs.ops.quant import Quant
        q = Quant(kind, 64, True) if kind == "nf4" else Quant(kind)
        kw["quant"] = tuple(sorted((fam.weight_name(i, t), q) for i in range(spec.layers) for t in fam.TARGETS))
    targets = MAMBA_PEER_TARGETS if spec.arch == "mamba" else fam.TARGETS  # what the PEFT peer trains
    train = TrainSpec(batch=B, seq=S, lora_targets=targets, rank=16, alpha=32, extra=fam.train_extra(target, 0), **kw)
    if embed:  # the tables as `lorac train --quantize-embeddings` holds them (runtime/model/quant/embeddings.py)
        from lorac.runtime.model.quant.embeddings import held
        train = held(spec, train, embed)
    if budget is not None:
        train = auto_checkpointing(spec, train, budget, on_host, chunk_free="loss_chunk" not in extra)
    from lorac.runtime.train.memory import host_table
    host = (host_table(spec),) if on_host else ()  # --offload-embeddings on
    optim = LoraPlusConfig(lr=1e-4, loraplus_ratio=16.0, warmup_steps=0, total_steps=100)  # the peers: no warmup
    eng = Engine(spec, train, weights or {}, target, None, cache, optim, log=lambda m: print(m, flush=True),
                 tune=tune, host_tables=host)  # the device's dtype: bf16 on cuda
    return eng, spec, optim


def auto_checkpointing(spec, train, budget_gb: float, on_host: bool = False, chunk_free: bool = True):
    """`train` with the checkpointing `lorac train --memory-budget budget_gb` picks (decoder shapes);
    on_host: the input embedding waits in host memory (--offload-embeddings on); chunk_free: no
    --loss-chunk given (auto may take smaller loss chunks to keep more layers)."""
    from dataclasses import replace

    from lorac.graphs.ops.quant import quant_inputs
    from lorac.runtime.train import memory as step_memory
    D, L, q, kv = spec.hidden, spec.layers, spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
    n_weights = spec.vocab * D * (1 if spec.tied else 2) + L * (2 * D * q + 2 * D * kv + 3 * D * spec.intermediate + 2 * D) + D
    packed = 0
    from lorac.runtime.model.quant.embeddings import frozen_with, tables
    layers = tuple((n, qt) for n, qt in train.quant if n not in tables(spec))
    for name, qt in layers:  # quantized projections: their blocks instead of dense elements
        out, inp = spec.proj_shape(name.split(".")[-2])
        n_weights -= out * inp
        packed += sum(int(np.prod(shape)) * np.dtype(dt).itemsize for _, shape, dt in quant_inputs(qt, name, out, inp))
    n_weights, packed = frozen_with(spec, (n_weights, packed), layers, train.quant)  # quantized embeddings
    n_weights, packed = step_memory.frozen_on_device(spec, (n_weights, packed), train.quant, on_host)
    budget, source = step_memory.budget_from(None, budget_gb)
    chunks = step_memory.loss_chunks(train.loss_chunk, train.batch * train.seq) if chunk_free else None
    c = step_memory.choose(spec, train, n_weights, "bfloat16", budget, source, packed, offload=True, chunks=chunks)
    chosen = replace(train, checkpointing=c.checkpointing, keep_layers=c.keep_layers, offload=c.offload,
                     loss_chunk=c.loss_chunk or train.loss_chunk, keep_mlp=c.keep_mlp)
    if c.offload and c.state_off:  # the attention state did not fit: the inputs alone (train/plan.py)
        chosen = replace(chosen, offload_state=False)
    from lorac.graphs.compose import offloads_state
    what = step_memory.describe(c.checkpointing, c.keep_layers, L, c.offload, offloads_state(spec, chosen),
                                keep_mlp=c.keep_mlp)
    print(f"memory: auto: {what} ({c.why})", flush=True)
    return chosen


def model_flops(cfg: dict, B: int, S: int) -> float:
    if cfg["model_type"] == "mamba":  # projections and head; the scan is ~1 % of it at these widths
        D, L, V, M = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"], cfg["state_size"]
        I, R = 2 * D, -(-D // 16)
        return 4.0 * (L * (D * 2 * I + I * (R + 2 * M) + R * I + I * D) + V * D) * B * S
    D, L, V, I = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"], cfg["intermediate_size"]
    H, K, Dh = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    matmul = L * (D * H * Dh * 2 + D * K * Dh * 2 + 3 * D * I) + V * D
    return 4.0 * matmul * B * S + 6.0 * L * B * S * S * H * Dh


SOURCE_FILE = "lorac_source.txt"  # in the cache: the source digest its artifacts were compiled from


def pin_source(cache: str) -> None:
    """Artifacts are keyed by lorac's source (core, graphs, compiler: lorac.core.keys.versions).
    When the cache says which source compiled it and this checkout's differs (a later commit
    that changed no graph or pass), use the cache's digest, and say so: the bench measures those
    artifacts, and compiling an 8B or 70B step again on the GPU machine is not possible there."""
    path = Path(cache) / SOURCE_FILE
    if not path.exists():
        return
    from lorac.core import keys
    pinned, ours = path.read_text().strip(), keys.versions()["lorac_source"]
    if pinned != ours:
        print(f"note: this checkout's source digest {ours[:12]} differs from the cache's {pinned[:12]}; "
              "using the cache's artifacts as compiled", flush=True)
        real = keys.versions
        keys.versions = lambda: {**real(), "lorac_source": pinned}


def prepare(cache: str, cases: list[str]) -> None:
    from lorac.core.keys import versions
    Path(cache).mkdir(parents=True, exist_ok=True)
    (Path(cache) / SOURCE_FILE).write_text(versions()["lorac_source"] + "\n")
    for case in cases:
        eng, _, _ = _engine(case, cache)
        for kind in ("train", "adamw"):
            art = eng.compile(kind)
            m = json.loads((art / "manifest.json").read_text())
            print(case, kind, art.name, m["memory"], m.get("units"), flush=True)


def _gpu_used() -> int:
    from lorac.runtime.devices.cuda import memory_info
    free, total = memory_info()
    return total - free


def case_engine(cache: str, case: str, tune: int = 0, target: str = "cuda"):
    """An engine for `case` with random frozen weights and LoRA state, ready to step:
    (engine, spec, optimizer config, manifest, batches, GPU bytes in use before loading;
    0 for another target than cuda)."""
    import ml_dtypes
    from lorac.runtime.engine.artifact import read_manifest
    from lorac.runtime.train.run import init_lora

    eng, spec, optim = _engine(case, cache, tune=tune, target=target)
    m = read_manifest(eng.compile("train"))  # a cache hit: the input names and dtypes
    base = 0
    if target == "cuda":
        _gpu_used()  # creates the CUDA context
        base = _gpu_used()
    rng = np.random.default_rng(0)
    block = (0.02 * rng.standard_normal(1 << 20)).astype(ml_dtypes.bfloat16)
    weights = {}
    for i in m["inputs"]:  # random frozen weights, tiled from one block (an 8B model in seconds)
        if i["name"] in ("input_ids", "labels", "position_ids") or "lora_" in i["name"]:
            continue
        shape = i["shape"][:-1] + [i["columns"]] if "columns" in i else i["shape"]  # a weight held joined: its own
        n = int(np.prod(shape))
        if ".weight." in i["name"]:  # a quantized weight's blocks and scales (graphs/ops/quant.py)
            weights[i["name"]] = random_quant_input(i["name"], i["shape"], i["dtype"], rng)
            continue
        w = np.ones(n, ml_dtypes.bfloat16) if "norm" in i["name"] else np.resize(block, n)
        weights[i["name"]] = w.reshape(shape)
    eng, spec, optim = _engine(case, cache, weights=weights, tune=tune, target=target)
    del weights
    zeros = {n: np.zeros(s, np.float32) for n, s in eng.shapes.items()}
    eng.set_state(init_lora(eng.shapes, np.random.default_rng(1)), zeros, dict(zeros))
    B, S = CASES[case][2], CASES[case][3]
    batches = [np.random.default_rng(2 + i).integers(0, spec.vocab, (B, S)).astype(np.int64) for i in range(4)]
    return eng, spec, optim, m, batches, base


def random_quant_input(name: str, shape, dtype: str, rng) -> np.ndarray:
    """Random blocks and plausible scales for a quantized weight's input: dequantized, the weight's
    entries are of the order of 0.02, as the dense cases' random weights."""
    suffix = name.rsplit(".", 1)[1]
    if dtype in ("uint8", "int8"):  # codes and blocks: random bytes
        return rng.integers(0, 256, int(np.prod(shape)), dtype=np.uint8).view(dtype).reshape(shape)
    if suffix == "nf4_code":
        from lorac.runtime.model.quant.nf4 import NF4_CODE
        return np.asarray(NF4_CODE, np.float32).reshape(shape)
    fill = {"absmax": 0.02, "absmax_code": None, "absmax_scale": 0.02, "absmax_offset": 0.01, "int8_scale": 0.02 / 127}
    if suffix == "absmax_code":
        return np.linspace(-1, 1, int(np.prod(shape)), dtype=np.float32).reshape(shape)
    return np.full(shape, fill.get(suffix, 0.02), np.float32)


def full_step(eng, optim, ids, t: int) -> float:
    """What `lorac train` runs each step: the compiled step, the LoRA+ AdamW update with
    clipping (its grad-norm read waits for the device), then the loss read back. -> the loss.
    ids: input ids (their own labels), or a whole batch dict (packed rows: with position_ids)."""
    from lorac.runtime.train.optim import group_lrs
    batch = ids if isinstance(ids, dict) else {"input_ids": ids, "labels": ids}
    out = eng.step(batch, eng.lora, read_loss=False)
    loss = out.pop("loss")
    eng.update(out, *group_lrs(t, optim), t)
    return float(loss.numpy())


def lorac_case(cache: str, case: str, steps: int = 10, tune: int = 0) -> dict:
    """One case's full steps in this process (no torch): ms per step, memory, losses.
    tune: the training step's kernels tuned with that many MetaSchedule trials."""
    sys.modules["torch"] = None
    eng, spec, optim, m, batches, base = case_engine(cache, case, tune)
    B, S = CASES[case][2], CASES[case][3]
    def in_use() -> float:  # GB this process holds beyond its bare CUDA context
        return round((_gpu_used() - base) / 1e9, 2)

    times, losses, mem = [], [], {"loaded": in_use()}
    t_first = time.perf_counter()
    for t in range(1, steps + 4):
        ids = batches[t % len(batches)]
        t0 = time.perf_counter()
        loss = full_step(eng, optim, ids, t)
        times.append(time.perf_counter() - t0)
        losses.append(round(loss, 5))
        if t == 1:
            first_s = time.perf_counter() - t_first
            mem["after_first_step"] = in_use()
    step_s = float(np.median(times[3:]))
    mem["after_steps"] = in_use()
    parts = _parts(eng, optim, batches)
    plan = m.get("memory", {})
    return dict(lorac=case, B=B, S=S, step_ms=round(step_s * 1e3, 2), tok_s=round(B * S / step_s),
                mem_gb=in_use(), plan_gb=round(plan.get("static_plan_bytes", 0) / 1e9, 2),
                first_step_s=round(first_s, 2), losses=losses[:3] + losses[-2:],
                mfu=round(model_flops(CASES[case][0], B, S) / step_s / PEAK, 3), parts_ms=parts, mem_stages_gb=mem)


def _parts(eng, optim, batches, n: int = 5) -> dict:
    """Where a full step's time goes: the compiled step alone (loss read back) and the update
    alone (grad-norm read back), each waited for, medians of n."""
    from lorac.runtime.train.optim import group_lrs
    step, update = [], []
    for i in range(n):
        t0 = time.perf_counter()
        out = eng.step({"input_ids": batches[i % len(batches)], "labels": batches[i % len(batches)]}, eng.lora)
        t1 = time.perf_counter()
        out.pop("loss")
        eng.update(out, *group_lrs(100 + i, optim), 100 + i)
        t2 = time.perf_counter()
        step.append(t1 - t0)
        update.append(t2 - t1)
    return {"step": round(float(np.median(step)) * 1e3, 2), "update": round(float(np.median(update)) * 1e3, 2)}


def _json_lines(text: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return out


def device(cache: str, cases: list[str], peer_timeout: int) -> None:
    rows = []
    for case in cases:
        r = subprocess.run([sys.executable, __file__, "lorac", cache, case], capture_output=True, text=True,
                           timeout=900)
        got = [x for x in _json_lines(r.stdout) if "lorac" in x]
        mine = got[0] if got else {"lorac": case, "error": (r.stderr.strip().splitlines() or ["?"])[-1][:400]}
        print(json.dumps(mine), flush=True)
        cfg, peer_model, B, S, _, modes = CASES[case]
        peers = []
        if os.environ.get("NO_PEERS"):
            modes = []
        fast = [m[len("fast:"):] for m in modes if m.startswith("fast:")]
        modes = [m for m in modes if not m.startswith("fast:")]
        if peer_model == "mamba":  # one process per mode: the torch path hides mamba_ssm from transformers
            commands = [(mode, ["peer_mamba.py", f"{B}x{S}", "2", mode, "--hidden", str(cfg["hidden_size"]),
                                "--layers", str(cfg["num_hidden_layers"])]) for mode in modes]
        else:
            commands = [(",".join(modes), ["peer_lora_gpu.py", peer_model, f"{B}x{S}", *modes])] if modes else []
        fast_script = os.environ.get("PEER_FAST", str(HERE / "peer_fast_gpu.py"))
        commands += [(mode, ["peer_in_use.py", str(HERE / fast_script), f"{peer_model}:{B}x{S}:{mode}"])
                     for mode in fast]  # HERE / PEER_FAST: relative to bench/, or an absolute path as it is
        for label, cmd in commands:
            try:
                p = subprocess.run([sys.executable, str(HERE / cmd[0]), *cmd[1:]], capture_output=True, text=True,
                                   timeout=peer_timeout, cwd=HERE)
                peers += _json_lines(p.stdout) or [{"mode": label, "error": (p.stderr.strip().splitlines()
                                                                             or ["?"])[-1][:300]}]
            except subprocess.TimeoutExpired as e:
                peers += _json_lines(e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or ""))
                peers.append({"mode": "timeout", "error": f"peers past {peer_timeout} s"})
        for x in peers:
            if "step_ms" in x:
                x["mfu"] = round(model_flops(cfg, B, S) / (x["step_ms"] / 1e3) / PEAK, 3)
            print(json.dumps(x), flush=True)
        rows.append((mine, peers))
    print("\n| case | lorac ms | lorac GB | lorac MFU | peer | peer ms | peer GB (in use/alloc/reserved) | peer MFU "
          "| peer ms / lorac ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for mine, peers in rows:
        for x in peers or [{"mode": "-"}]:
            ratio = round(x["step_ms"] / mine["step_ms"], 2) if "step_ms" in x and "step_ms" in mine else "-"
            print(f"| {mine['lorac']} | {mine.get('step_ms', mine.get('error'))} | {mine.get('mem_gb', '-')} | "
                  f"{mine.get('mfu', '-')} | {x['mode']} | {x.get('step_ms', x.get('error', '-'))} | "
                  f"{x.get('in_use_gb', '-')}/{x.get('peak_gb', '-')}/{x.get('peak_reserved_gb', '-')} | "
                  f"{x.get('mfu', '-')} | {ratio} |")


if __name__ == "__main__":
    mode, cache, rest = sys.argv[1], sys.argv[2], sys.argv[3:]
    if mode != "prepare":
        pin_source(cache)
    if mode == "prepare":
        prepare(cache, rest or list(CASES))
    elif mode == "lorac":  # CASE [TUNE_TRIALS]
        print(json.dumps(lorac_case(cache, rest[0], tune=int(rest[1]) if len(rest) > 1 else 0)), flush=True)
    else:
        timeout = int(os.environ.get("PEER_TIMEOUT", "420"))
        device(cache, rest or list(CASES), timeout)
