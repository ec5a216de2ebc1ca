"""Frozen prefix, activation checkpointing and the chunked loss compute the same gradients as
the plain graph; oracle 1 on a whole model (float64 finite differences); oracle 3
(onnxruntime-training's autodiff) on the eval graph."""
import numpy as np
import pytest

from lorac.graphs.builder import inline_units
from lorac.graphs import ALL_TARGETS, ModelSpec, TrainSpec, build_eval_graph, build_training_graph
from lorac.graphs.memory import peak_live_bytes
from oracles import assert_frozen_prefix_matches, batch, hf_model, hf_weights, random_lora, rel_err, run_ort

CFG = dict(model_type="qwen3", vocab_size=41, hidden_size=26, num_hidden_layers=3, num_attention_heads=6,
           num_key_value_heads=2, head_dim=6, intermediate_size=35, tie_word_embeddings=True)


def _random_weights(spec_cfg, dtype=np.float32, seed=0):
    pytest.importorskip("transformers")
    return {k: v.astype(dtype) for k, v in hf_weights(hf_model(spec_cfg, seed)).items()}


def _feeds(cfg, train, dtype=np.float32):
    spec = ModelSpec.from_hf_config(cfg)
    ids, labels = batch(spec, train)
    lora = {k: v.astype(dtype) for k, v in random_lora(spec, train).items()}
    return spec, {**_random_weights(cfg, dtype), **lora, "input_ids": ids, "labels": labels}


def _grads(out):
    return {k: v for k, v in out.items() if k.endswith(".grad")}


def test_frozen_prefix_matches_full_backward():
    full = TrainSpec(batch=2, seq=6, lora_targets=ALL_TARGETS, rank=3, alpha=6)
    spec, feeds = _feeds(CFG, full)
    for k in feeds:  # layer 0 adapters with B = 0 leave the forward as the prefix graph has it
        if ".layers.0." in k and ".lora_B." in k:
            feeds[k] = np.zeros_like(feeds[k])
    ref = run_ort(build_training_graph(spec, full), feeds)
    prefix = TrainSpec(batch=2, seq=6, lora_targets=ALL_TARGETS, rank=3, alpha=6, trained_layers=range(1, 3))
    assert_frozen_prefix_matches(build_training_graph(spec, prefix), feeds, ref)


@pytest.mark.parametrize("variant", [dict(checkpointing=True), dict(loss_chunk=5), dict(checkpointing=True, loss_chunk=4),
                                     dict(checkpointing=True, keep_layers=1), dict(checkpointing=True, keep_layers=3)])
def test_variant_matches_plain(variant):
    plain = TrainSpec(batch=2, seq=7, lora_targets=ALL_TARGETS, rank=3, alpha=6)
    spec, feeds = _feeds(CFG, plain)
    ref = run_ort(build_training_graph(spec, plain), feeds)
    other = TrainSpec(batch=2, seq=7, lora_targets=ALL_TARGETS, rank=3, alpha=6, **variant)
    out = run_ort(build_training_graph(spec, other), feeds)
    assert abs(out["loss"] - ref["loss"]) <= 1e-6 * abs(ref["loss"])
    for k, v in _grads(ref).items():
        assert rel_err(out[k], v) <= 1e-5, k


def test_checkpointing_lowers_peak_live_bytes():
    cfg = dict(CFG, num_hidden_layers=6)
    spec = ModelSpec.from_hf_config(cfg)
    kw = dict(batch=2, seq=32, lora_targets=ALL_TARGETS, rank=4, alpha=8)
    plain = peak_live_bytes(build_training_graph(spec, TrainSpec(**kw)))
    ckpt = peak_live_bytes(build_training_graph(spec, TrainSpec(checkpointing=True, **kw)))
    assert ckpt < 0.6 * plain, (ckpt, plain)
    # keeping the top three layers' activations lands in between
    part = peak_live_bytes(build_training_graph(spec, TrainSpec(checkpointing=True, keep_layers=3, **kw)))
    assert ckpt < part < plain, (ckpt, part, plain)
    assert [TrainSpec(checkpointing=True, keep_layers=3, **kw).recomputes(spec, i) for i in range(6)] == [True] * 3 + [False] * 3
    # with checkpointing, a kept layer keeps only what costs a GEMM or attention to recompute
    # (decoder.Saved): keeping all six layers needs less than no checkpointing, which keeps
    # the norms' outputs and silu(gate) * up too
    lean = peak_live_bytes(build_training_graph(spec, TrainSpec(checkpointing=True, keep_layers=6, **kw)))
    assert part < lean < plain, (part, lean, plain)


def test_whole_model_finite_differences_float64():
    cfg = dict(CFG, num_hidden_layers=2, tie_word_embeddings=False)
    train = TrainSpec(batch=2, seq=5, lora_targets=ALL_TARGETS, rank=2, alpha=4)
    spec, feeds = _feeds(cfg, train, np.float64)
    model = build_training_graph(spec, train, dtype="float64")
    out = run_ort(model, feeds)
    loss_model = build_eval_graph(spec, train, dtype="float64")
    rng = np.random.default_rng(7)
    eps = 1e-6
    names = sorted(_grads(out))
    for gname in names[::3] + [names[-1]]:
        name = gname[: -len(".grad")]
        v = rng.standard_normal(feeds[name].shape)
        plus, minus = dict(feeds), dict(feeds)
        plus[name] = feeds[name] + eps * v
        minus[name] = feeds[name] - eps * v
        fd = (run_ort(loss_model, plus)["loss"] - run_ort(loss_model, minus)["loss"]) / (2 * eps)
        an = float(np.sum(out[gname] * v))
        assert abs(fd - an) <= 1e-6 * max(1.0, abs(fd)), (name, fd, an)


def test_onnxruntime_training_autodiff_agrees(tmp_path):
    """Oracle 3: ORT-training differentiates lorac's eval graph; its LoRA gradients must match ours."""
    from onnx import numpy_helper
    from ort_training import oracle_folder, ort_training_grads
    oracle_folder()  # skip before building anything where the oracle is not installed
    train = TrainSpec(batch=2, seq=6, lora_targets=ALL_TARGETS, rank=3, alpha=6)
    spec, feeds = _feeds(CFG, train)
    ours = run_ort(build_training_graph(spec, train), feeds)
    fwd = inline_units(build_eval_graph(spec, train))  # ORT's autodiff reads plain ops
    weights = [n.name for n in fwd.graph.input if n.name not in ("input_ids", "labels")]
    keep = [i for i in fwd.graph.input if i.name in ("input_ids", "labels")]
    del fwd.graph.input[:]
    fwd.graph.input.extend(keep)
    fwd.graph.initializer.extend(numpy_helper.from_array(feeds[n], n) for n in weights)
    lora = [n for n in weights if ".lora_" in n]
    loss, theirs = ort_training_grads(fwd, {k: feeds[k] for k in ("input_ids", "labels")}, lora, tmp_path)
    assert abs(loss - float(ours["loss"])) <= 1e-5 * abs(loss)
    for n in lora:
        assert rel_err(ours[n + ".grad"], theirs[n]) <= 1e-4, n


def test_auto_loss_chunk_bounds_the_logits():
    """CUDA's default loss chunk: a power of two whose fp32 [chunk, V] logits fit 1.5 GiB,
    or one chunk when every token's logits fit."""
    from lorac.graphs.ops.loss import auto_chunk
    assert auto_chunk(151936, 8 * 1024) == 2048 and auto_chunk(128256, 4 * 2048) == 2048
    assert auto_chunk(32000, 8 * 1024) == 0 and auto_chunk(49152, 4 * 256) == 0
    for vocab, tokens in ((151936, 16384), (256000, 65536), (1000, 10 ** 7)):
        c = auto_chunk(vocab, tokens)
        assert c & (c - 1) == 0 and c * vocab * 4 <= 3 << 29 < 2 * c * vocab * 4
