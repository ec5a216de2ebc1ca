"""Quantized embeddings (`--quantize-embeddings`; runtime/model/quant/embeddings.py, graphs/ops/quant.py
QuantWeight.rows / row_slice, graphs/ops/loss.py head_slices): the head's vocabulary slices, the
bytes the tables take and the estimate saves, the plan's choice (auto and explicit) and the
one-line errors. No compile, no training (the unit tier); the graphs' numbers against the dense
graphs are tests/test_qlora_embeddings.py."""
from __future__ import annotations

import numpy as np
import pytest

from _compiler_graphs import nf4_layers
from lorac.core.errors import LoracError

LLAMA3_8B = dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
                 rope_theta=500000.0)
LLAMA3_70B = {**LLAMA3_8B, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
              "num_attention_heads": 64}
SMALL = dict(model_type="qwen3", vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)


def _spec(config):
    from lorac.graphs import ModelSpec
    return ModelSpec.from_hf_config(config)



def test_head_slices_cover_the_vocabulary_in_slices_of_about_96_mb():
    from lorac.graphs.ops.loss import HEAD_SLICE_BYTES, head_slices
    for vocab, hidden, count, rows in ((128256, 4096, 11, 11712), (128256, 8192, 21, 6144)):
        parts = head_slices(vocab, hidden)
        assert len(parts) == count and parts[0] == (0, rows) and parts[-1][1] == vocab
        assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))  # contiguous, in order
        assert all(hi - lo <= rows for lo, hi in parts) and rows % 64 == 0
        assert 64 << 20 <= rows * hidden * 2 <= HEAD_SLICE_BYTES + 64 * hidden * 2  # bf16 ~64-128 MB
    assert head_slices(100, 64) == [(0, 100)]  # a small head: one slice
    assert head_slices(100, 64, 3) == [(0, 34), (34, 68), (68, 100)]  # TrainSpec.head_slices
    assert head_slices(5, 64, 8) == [(k, k + 1) for k in range(5)]  # never an empty slice


def test_tables_that_cannot_be_read_by_rows_are_one_line_naming_the_flag():
    from lorac.graphs.ops.quant import Quant, check_rows
    from lorac.runtime.model.quant.embeddings import embedding_quant
    with pytest.raises(LoracError, match="nf4 rows of 48 values are not whole 64-value blocks"):
        check_rows(Quant("nf4", 64, False), "t", 100, 48)
    with pytest.raises(LoracError, match="double-quantized nf4 absmax groups blocks across rows"):
        check_rows(Quant("nf4", 64, True), "t", 100, 64)
    check_rows(Quant("int8"), "t", 100, 48)  # a scale per row: any width
    check_rows(Quant("Q8_0"), "t", 100, 64)  # GGUF's rows of blocks
    spec = _spec({**SMALL, "hidden_size": 48, "head_dim": 12})
    with pytest.raises(LoracError) as e:
        embedding_quant(spec, "nf4")
    assert str(e.value).startswith("--quantize-embeddings nf4: hidden size 48 (tensor model.embed_tokens.weight: nf4 rows")
    assert "\n" not in str(e.value) and "int8 can" in str(e.value)
    assert [n for n, _ in embedding_quant(spec, "int8")] == ["model.embed_tokens.weight", "lm_head.weight"]
    tied = _spec({**SMALL, "tie_word_embeddings": True})
    assert [n for n, _ in embedding_quant(tied, "nf4")] == ["model.embed_tokens.weight"]  # one table for both reads
    mamba = _spec(dict(model_type="mamba", vocab_size=40, hidden_size=64, state_size=4, num_hidden_layers=2, expand=2,
                       tie_word_embeddings=False))
    assert [n for n, _ in embedding_quant(mamba, "nf4")] == ["backbone.embeddings.weight", "lm_head.weight"]


@pytest.mark.parametrize("kind,tied", [("nf4", False), ("int8", False), ("nf4", True)])
def test_quantized_tables_hold_the_bytes_the_plan_counts(kind, tied):
    """quantize_tables through the references: arrays of exactly table_bytes; frozen_sizes of the
    quantized weights = frozen_with of the dense ones; each table dequantizes to its reference."""
    from lorac.graphs import TrainSpec
    from lorac.runtime.model.quant import dense_weight
    from lorac.runtime.model.quant.embeddings import frozen_with, held, quantize_tables, table_bytes
    from lorac.runtime.train.memory import frozen_sizes
    spec = _spec({**SMALL, "tie_word_embeddings": tied})
    rng = np.random.default_rng(0)
    weights = {"model.embed_tokens.weight": rng.standard_normal((100, 64)).astype(np.float32),
               "model.norm.weight": np.ones(64, np.float32)}
    if not tied:
        weights["lm_head.weight"] = rng.standard_normal((100, 64)).astype(np.float32)
    train = held(spec, TrainSpec(batch=1, seq=8), kind)
    out = quantize_tables(weights, train.quant)
    tables = ["model.embed_tokens.weight"] + ([] if tied else ["lm_head.weight"])
    assert not set(tables) & set(out) and out["model.norm.weight"] is weights["model.norm.weight"]
    held_bytes = sum(a.nbytes for k, a in out.items() if k.startswith(tuple(f"{t}." for t in tables)))
    per_table = 100 * 64 // 2 + 100 * 64 // 64 * 4 + 16 * 4 if kind == "nf4" else 100 * 64 + 100 * 4
    assert held_bytes == table_bytes(spec, train.quant) == per_table * len(tables)
    assert frozen_sizes(out) == frozen_with(spec, frozen_sizes(weights), (), train.quant)
    for t in tables:
        w, got = weights[t], dense_weight(out, t)
        assert np.abs(got - w).max() <= (np.abs(w).max() / (7 if kind == "nf4" else 254)) * 1.01  # a code step at most


def test_the_estimate_shrinks_by_the_tables_and_the_head_gradient(monkeypatch):
    """Llama-3-8B shape 1x2048, NF4 layers, every layer recomputed: NF4 tables take 0.59 GB instead of
    2.10 GB in bf16, and the loss holds one slice's logit gradient instead of the whole [T, V] one;
    the dequantization workspace stays a projection's (a head slice is smaller)."""
    from dataclasses import replace

    from lorac.graphs import TrainSpec
    from lorac.runtime.model.quant.embeddings import frozen_with, held
    from lorac.runtime.train import memory
    spec = _spec(LLAMA3_8B)
    V, D, T = 128256, 4096, 2048
    train = TrainSpec(batch=1, seq=T, lora_targets=("q_proj", "v_proj"), rank=16, quant=nf4_layers(spec),
                      checkpointing=True, offload=True)
    dense = (V * D * 2 + 32 * 2 * D + D, 3_601_000_000)  # frozen sizes as the loaded NF4 base has them
    q = held(spec, train, "nf4")
    n_weights, packed = frozen_with(spec, dense, train.quant, q.quant)
    assert dense[0] - n_weights == 2 * V * D
    assert packed - dense[1] == 2 * (V * D // 2 + V * D // 64 * 4 + 16 * 4)  # codes, fp32 absmax, the code
    before = memory.estimate(spec, train, *dense[:1], "bfloat16", dense[1])
    after = memory.estimate(spec, q, n_weights, "bfloat16", packed)
    weights = 2 * 2 * V * D - (packed - dense[1])
    loss = 4 * T * V - 2 * T * (V + 11712)  # dlogits [T, V] -> one 11712-row slice wide
    assert memory.dequant_workspace(spec, q, "bfloat16") == memory.dequant_workspace(spec, train, "bfloat16")
    assert before - after == weights + loss
    assert 1.98e9 < before - after < 2.0e9
    # the same with the head given as 3 slices: the slice is wider than a projection -> a larger workspace
    wide = replace(q, head_slices=3)
    assert memory.dequant_workspace(spec, wide, "bfloat16") == 2 * 42752 * D * 2
    # with LORA_K_GROUPS q and v (together wider than their input) join: beside it the copy of x they share
    # with their u, [T, D + 2 r]
    from lorac.core import constants
    monkeypatch.setattr(constants, "LORA_K_GROUPS", True)
    assert memory.dequant_workspace(spec, wide, "bfloat16") == 2 * 42752 * D * 2 + 2 * T * (D + 2 * 16)


def _plan(monkeypatch, config, quant, **settings):
    from lorac.runtime import devices
    from lorac.runtime.config import TrainConfig
    from lorac.runtime.train.plan import plan_run
    monkeypatch.setattr(devices.for_target("cuda"), "memory_free", lambda: None)  # no GPU: the budget given
    monkeypatch.setattr(devices.for_target("cpu"), "memory_free", lambda: 512 * 10**9)  # the host: room to pin
    spec = _spec(config)
    frozen = (spec.vocab * spec.hidden * 2 + spec.layers * 2 * spec.hidden + spec.hidden,
              3_601_000_000 if quant else 0)
    logs = []
    cfg = TrainConfig(**{"target": "cuda", "batch": 1, "seq": 2048, "rank": 16, "alpha": 32.0, **settings})
    return plan_run(cfg, spec, config, frozen, quant=quant, log=logs.append), logs


def test_auto_quantizes_the_tables_only_where_nothing_fits_with_them_dense(monkeypatch):
    spec = _spec(LLAMA3_8B)
    layers = nf4_layers(spec)
    # (with the input table in host memory dense tables fit 8 GB: tests/test_host_embeddings.py)
    plan, logs = _plan(monkeypatch, LLAMA3_8B, layers, memory_budget=8.0, offload_embeddings="off")
    assert plan.cfg.quantize_embeddings == "nf4"  # recorded as resolved (checkpoints, --resume)
    assert {"model.embed_tokens.weight", "lm_head.weight"} <= set(dict(plan.train.quant))
    assert dict(plan.train.quant)["lm_head.weight"].double is False
    assert logs[1].startswith("embeddings: auto: nf4 (with dense embeddings even full checkpointing needs an estimated")
    # keeping 1 layer, the others' inputs and attention state offloaded (two staging slots and the one
    # fetched ahead, 0.23 GB), 6 of those keeping their MLP half: 7 layers without a recompute where 4
    # kept whole would fit
    assert logs[2].startswith("memory: auto: checkpointing on, keeping 1 of 32 layers, their inputs and attention "
                              "state offloaded") and "estimated 6.9 GB of a 6.9 GB" in logs[2]
    assert "; 6 of those keep their MLP's gate and up on the GPU" in logs[2] and plan.train.keep_mlp == 6
    assert logs[3].startswith("embeddings: model.embed_tokens.weight and lm_head.weight held as nf4: 0.59 GB")
    plan, logs = _plan(monkeypatch, LLAMA3_8B, layers, memory_budget=10.0, offload_embeddings="off")  # dense fit
    assert plan.cfg.quantize_embeddings == "off" and not any(n.startswith(("model.embed", "lm_head"))
                                                             for n, _ in plan.train.quant)
    assert not any(line.startswith("embeddings") for line in logs)
    plan, _ = _plan(monkeypatch, LLAMA3_8B, (), memory_budget=8.0, offload_embeddings="off")  # a dense base: dense
    assert plan.cfg.quantize_embeddings == "off"
    plan, _ = _plan(monkeypatch, LLAMA3_8B, layers, memory_budget=8.0, checkpointing="offload")  # no memory choice
    assert plan.cfg.quantize_embeddings == "off"
    plan, _ = _plan(monkeypatch, LLAMA3_8B, layers, memory_budget=48.0, quantize_embeddings="int8")  # asked for
    assert plan.cfg.quantize_embeddings == "int8" and dict(plan.train.quant)["lm_head.weight"].kind == "int8"
    plan, _ = _plan(monkeypatch, LLAMA3_8B, (), target="cpu", quantize_embeddings="nf4")  # any device, any base
    assert plan.cfg.quantize_embeddings == "nf4" and len(plan.train.quant) == 2


def test_a_resumed_run_takes_the_checkpoints_choice(monkeypatch):
    from lorac.runtime import devices
    from lorac.runtime.config import TrainConfig
    from lorac.runtime.train.plan import plan_run
    from lorac.runtime.train.saved import SavedRun
    monkeypatch.setattr(devices.for_target("cuda"), "memory_free", lambda: None)
    spec = _spec(LLAMA3_8B)
    saved = SavedRun.from_state({"train_config": {"checkpointing": "offload", "keep_layers": 0,
                                                  "quantize_embeddings": "nf4"}})
    cfg = TrainConfig(target="cuda", batch=1, seq=2048, resume="ckpt", memory_budget=48.0)
    plan = plan_run(cfg, spec, LLAMA3_8B, (V := 128256 * 4096 * 2, 3_601_000_000), quant=nf4_layers(spec),
                    saved=saved)
    assert plan.cfg.quantize_embeddings == "nf4" and plan.cfg.checkpointing == "offload"  # budget 48 would not need it
    old = SavedRun.from_state({"train_config": {"checkpointing": "on"}})  # before the setting: dense
    plan = plan_run(cfg, spec, LLAMA3_8B, (V, 3_601_000_000), quant=nf4_layers(spec), saved=old)
    assert plan.cfg.quantize_embeddings == "off"


def test_settings_are_checked_in_one_line():
    from lorac.runtime.config import TrainConfig
    with pytest.raises(LoracError, match="--quantize-embeddings must be auto, off, nf4, int8, got 'fp8'"):
        TrainConfig(quantize_embeddings="fp8").validate()
    with pytest.raises(LoracError, match="--quantize-embeddings nf4 holds the embeddings quantized; it cannot be"):
        TrainConfig(quantize_embeddings="nf4", quantized_base="dequantize").validate()
    TrainConfig(quantize_embeddings="off", quantized_base="dequantize").validate()


def test_the_memory_line_says_what_the_tables_take():
    from lorac.core.manifest import Manifest
    from lorac.runtime.engine.tvm import memory_summary
    inputs = [{"name": "model.embed_tokens.weight.nf4", "shape": [128256, 2048], "dtype": "uint8"},
              {"name": "model.embed_tokens.weight.absmax", "shape": [128256 * 64], "dtype": "float32"},
              {"name": "model.layers.0.mlp.up_proj.weight.nf4", "shape": [14336, 2048], "dtype": "uint8"},
              {"name": "model.norm.weight", "shape": [4096], "dtype": "float32"}]
    line = memory_summary(Manifest.from_json({"memory": {"static_plan_bytes": 10**9}, "inputs": inputs}), {}, "cuda",
                          ("model.embed_tokens.weight", "lm_head.weight"))
    assert "quantized weights 0.3 GB (of which embeddings 0.3 GB)" in line
    assert "of which" not in memory_summary(Manifest.from_json({"memory": {"static_plan_bytes": 1}, "inputs": inputs[2:]}),
                                            {}, "cuda", ("model.embed_tokens.weight", "lm_head.weight"))


def test_rows_and_slices_emit_only_what_they_read():
    """The lookup gathers rows of the codes and of the absmax (never a [V, D] value in the graph);
    a slice's values are [hi - lo, D]; a dense table is a plain Gather."""
    from lorac.graphs.builder import INT64, GraphBuilder
    from lorac.graphs.ops.linear import gather_rows
    from lorac.graphs.ops.quant import Quant, declare
    g = GraphBuilder("rows")
    table = declare(g, Quant("nf4", 64, False), "t", 1000, 128)
    ids = g.input("ids", [2, 3], INT64)
    g.output(gather_rows(g, table, ids, 6, 128), "rows")
    g.output(table.row_slice(g, 10, 30), "slice")
    model = g.finish()
    sizes = {v.name: int(np.prod([d.dim_value for d in v.type.tensor_type.shape.dim])) for v in model.graph.value_info}
    assert [d.dim_value for d in model.graph.output[0].type.tensor_type.shape.dim] == [6, 128]
    assert [d.dim_value for d in model.graph.output[1].type.tensor_type.shape.dim] == [20, 128]
    assert max(sizes.values()) <= 20 * 128, sorted(sizes.items(), key=lambda kv: -kv[1])[:3]  # never 1000 x 128
