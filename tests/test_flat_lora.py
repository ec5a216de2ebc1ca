"""graphs/flat_lora.py: the training and forward graphs with the LoRA tensors as the
optimizer's flat buckets compute what the per-tensor graphs compute (onnxruntime, fp32),
also with more tensors in a bucket than one Concat takes; a graph missing a tensor is
refused."""
import numpy as np
import pytest

from tiny_model import make_model_dir

ort = pytest.importorskip("onnxruntime")


def _run(model, feeds):
    s = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in s.get_outputs()]
    return dict(zip(names, s.run(None, {i.name: feeds[i.name] for i in s.get_inputs()})))


@pytest.mark.parametrize("layers,chunk", [(2, 16), (3, 4)])
def test_flat_graphs_equal_the_per_tensor_graphs(tmp_path, monkeypatch, layers, chunk):
    from lorac.graphs import ModelSpec, TrainSpec, build_forward_graph, build_training_graph
    from lorac.graphs import flat_lora
    from lorac.graphs.optimizer import buckets, pack, unpack
    from lorac.runtime.engine.graphs import _lora_shape
    from lorac.runtime.train.run import init_lora
    from lorac.runtime.model.weights import load_model

    monkeypatch.setattr(flat_lora, "CHUNK", chunk)  # 3 layers x 7 targets = 21 per bucket: a tree of Concats
    cfg, weights = load_model(make_model_dir(tmp_path, layers=layers))
    spec = ModelSpec.from_hf_config(cfg)
    train = TrainSpec(batch=2, seq=7, lora_targets=tuple(spec.targets), rank=3, alpha=6.0)
    model = build_training_graph(spec, train)
    from lorac.graphs import lora_tensor_names
    shapes = {n: _lora_shape(spec, train, n) for n in lora_tensor_names(spec, train)}
    lora = init_lora(shapes, np.random.default_rng(1))
    lora = {n: a + 0.01 for n, a in lora.items()}  # B != 0: every gradient non-zero
    ids = np.random.default_rng(0).integers(0, spec.vocab, (2, 7)).astype(np.int64)
    feeds = {**{n: np.asarray(w, np.float32) for n, w in weights.items()}, **lora, "input_ids": ids, "labels": ids}
    flat = flat_lora.flat_lora_io(model, shapes)
    bks = buckets(shapes)
    assert {i.name for i in flat.graph.input} >= {f"{b.key}.param" for b in bks}
    assert not any(".lora_" in i.name for i in flat.graph.input)
    assert sorted(o.name for o in flat.graph.output) == sorted(["loss"] + [f"{b.key}.grad" for b in bks])
    want = _run(model, feeds)
    got = _run(flat, {**feeds, **{f"{k}.param": v for k, v in pack(bks, lora).items()}})
    assert got["loss"] == want["loss"]
    per_tensor = unpack(bks, {b.key: got[f"{b.key}.grad"] for b in bks})
    assert set(per_tensor) == set(shapes)
    for n in shapes:
        assert np.abs(want[n + ".grad"]).max() > 0
        np.testing.assert_array_equal(per_tensor[n], want[n + ".grad"])
    fwd = build_forward_graph(spec, train)
    fwd_flat = flat_lora.flat_lora_io(fwd, shapes)
    np.testing.assert_array_equal(_run(fwd_flat, {**feeds, **{f"{k}.param": v for k, v in pack(bks, lora).items()}})["logits"],
                                  _run(fwd, feeds)["logits"])


def test_a_graph_without_the_tensors_is_refused(tmp_path):
    from lorac.graphs import ModelSpec, TrainSpec, build_training_graph
    from lorac.graphs.flat_lora import flat_lora_io
    from lorac.runtime.model.weights import load_model

    cfg, _ = load_model(make_model_dir(tmp_path))
    spec = ModelSpec.from_hf_config(cfg)
    model = build_training_graph(spec, TrainSpec(batch=1, seq=4, lora_targets=("q_proj",), rank=2))
    with pytest.raises(ValueError, match="no input"):
        flat_lora_io(model, {"base_model.model.nothing.lora_A.weight": (2, 4)})
