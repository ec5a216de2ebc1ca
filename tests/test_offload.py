"""Activation offload (`--checkpointing offload`, graphs/ops/offload.py): checkpointed inputs wait in
host memory. The graph computes what plain checkpointing computes; the CUDA build maps the
units to the runtime's copies, and the plan no longer holds the inputs."""
from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from _compiler_graphs import cuda_plan
from conftest import has_cuda_gpu
from lorac.graphs import ModelSpec, TrainSpec, build_training_graph
from lorac.graphs.spec import ALL_TARGETS

SPEC = ModelSpec(arch="qwen3", vocab=96, hidden=64, layers=4, heads=4, kv_heads=2, head_dim=16, intermediate=80,
                 qk_norm=True, tied=True)
TRAIN = TrainSpec(batch=2, seq=48, lora_targets=ALL_TARGETS, rank=4, alpha=8.0, checkpointing=True, keep_layers=1)


def _feeds(model, seed=0):
    import onnxruntime as ort
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(seed)
    feeds = {i.name: (rng.integers(0, SPEC.vocab, i.shape).astype(np.int64) if "int64" in i.type
                      else (0.1 * rng.standard_normal(i.shape)).astype(np.float32)) for i in sess.get_inputs()}
    return sess, feeds


def test_offloaded_graph_computes_what_checkpointing_computes():
    plain = build_training_graph(SPEC, TRAIN)
    off = build_training_graph(SPEC, replace(TRAIN, offload=True))
    units = [n.op_type for n in off.graph.node if n.domain]
    assert units.count("Offload") == units.count("Fetch") == 3  # layers 0-2 recomputed, layer 3 kept
    (s1, feeds), (s2, _) = _feeds(plain), _feeds(off)
    for a, b in zip(s1.run(None, feeds), s2.run(None, feeds)):
        assert np.array_equal(a, b)
    with pytest.raises(ValueError, match="needs checkpointing"):
        replace(TRAIN, checkpointing=False, keep_layers=0, offload=True).validate(SPEC)


def test_cuda_build_maps_offload_and_plans_without_the_inputs(tmp_path):
    from lorac.compiler import compile_graph
    model = build_training_graph(SPEC, replace(TRAIN, offload=True))
    art = compile_graph(model, target={"kind": "cuda", "cuda_graph": True}, out_dir=tmp_path / "a", dtype="bfloat16")
    m = json.loads((art / "manifest.json").read_text())
    assert {"Offload", "Fetch"} <= set(m["units"])
    calls = sorted((c["slot"], c["shape"], c["dtype"]) for c in m["unit_calls"] if c["function"] == "lorac.offload")
    assert calls == [(i, [TRAIN.batch * TRAIN.seq, SPEC.hidden], "bfloat16") for i in range(3)]
    # 12 layers, all recomputed: the plan drops by the inputs of all but the few live at its peak
    spec, big = replace(SPEC, layers=12), replace(TRAIN, batch=4, seq=256, keep_layers=0)
    plain = cuda_plan(build_training_graph(spec, big), "bfloat16", cuda_graph=True)["static_plan_bytes"]
    off = cuda_plan(build_training_graph(spec, replace(big, offload=True)), "bfloat16", cuda_graph=True)["static_plan_bytes"]
    per_layer = big.batch * big.seq * SPEC.hidden * 2  # one layer's bf16 input
    assert plain - off >= (spec.layers - 3) * per_layer, (plain, off, per_layer)


def test_the_estimate_counts_offload_and_auto_picks_it_when_it_must():
    from lorac.runtime.train import memory
    cfg = dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False)
    spec = ModelSpec.from_hf_config(cfg)
    train = TrainSpec(batch=4, seq=2048, lora_targets=spec.targets, rank=16, alpha=32.0, loss_chunk=1024)
    full = replace(train, checkpointing=True)
    # the plans of compiled steps (bench: cuda_plan of this shape): 3.49 GB plain, 1.53 GB offloaded
    assert memory.plan_bytes(spec, full) == pytest.approx(3.49e9, rel=0.06)
    assert memory.plan_bytes(spec, replace(full, offload=True)) == pytest.approx(1.53e9, rel=0.06)
    n = 8 * 10 ** 9
    lean = memory.estimate(spec, full, n)
    tight = memory.choose(spec, train, n, "bfloat16", lean - 10 ** 9, "test", offload=True)
    assert tight.checkpointing and tight.offload
    assert not memory.choose(spec, train, n, "bfloat16", lean - 10 ** 9, "test").offload  # a device that cannot
    roomy = memory.choose(spec, train, n, "bfloat16", 200 * 10 ** 9, "test", offload=True)
    assert not roomy.checkpointing and not roomy.offload


@pytest.mark.gpu
def test_offloaded_step_equals_the_checkpointed_step_on_the_gpu(tmp_path):
    """Copies only: the offloaded CUDA-graph step gives the checkpointed step's loss and
    gradients bit for bit, over several steps (replays of the captured graph)."""
    assert has_cuda_gpu()
    from lorac.compiler import compile_graph
    from lorac.runtime import load_artifact
    outs = []
    for off in (False, True):
        model = build_training_graph(SPEC, replace(TRAIN, offload=off))
        art = compile_graph(model, target={"kind": "cuda", "cuda_graph": True}, out_dir=tmp_path / str(off),
                            dtype="bfloat16")
        step = load_artifact(art, device="cuda")
        _, feeds = _feeds(model)
        outs.append([step(feeds) for _ in range(3)])
    for a, b in zip(*outs):
        for k in a:
            assert np.array_equal(a[k], b[k]), k
