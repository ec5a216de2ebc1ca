"""The ONNX dequantizers of graphs/ops/quant.py against the numpy references (runtime/model/quant),
through onnxruntime (CPU EP: bit for bit) and through a TVM CPU artifact (every value equal,
bits equal except the sign of a zero: TVM's CPU code returns +0 for some -0), at odd shapes
and on a projection of the bundled SmolLM2 Q4_1 file; the in-graph fp16 decoding over all
65536 bit patterns; a training graph over quantized weights; and that file's kept blocks
against its dense load."""
from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

from lorac.graphs.builder import GraphBuilder
from lorac.graphs.ops.quant import GGUF_BLOCKS, Quant, declare, detect, f16
from lorac.runtime.model.quant import dense_weight, quantize_one
from lorac.runtime.model.quant import nf4
from test_gguf import SMOLLM, needs_smollm
from test_quant_formats import finite_blocks

# (name, Quant, out, in): out not a power of two, several blocks a row or several rows a block;
# nf4 with 3 (double: 544 blocks = 2 whole nested blocks + 1 partial) or 45 absmax blocks
NF4 = [("nf4", Quant("nf4", 64, False), 136, 256), ("nf4d", Quant("nf4", 64, True), 136, 256),
       ("nf4s", Quant("nf4", 64, True), 90, 32), ("nf4b", Quant("nf4", 128, True), 24, 96)]
CASES = NF4 + [("int8", Quant("int8"), 40, 72)] + [
    (k, Quant(k), 24, 96 if GGUF_BLOCKS[k][0] == 32 else 512) for k in GGUF_BLOCKS]


def case_arrays(rng):
    feeds = {}
    for name, q, out, inp in CASES:
        if q.kind in GGUF_BLOCKS:
            feeds[f"{name}.{q.kind}"] = finite_blocks(q.kind, out, inp, rng)
        else:
            w = (rng.standard_normal((out, inp)) * rng.uniform(0.01, 4, (out, 1))).astype(np.float32)
            if q.kind == "nf4":
                arrays = {f"{name}.{k}": v for k, v in nf4.quantize(w, q.block, q.double).items()}
            else:
                arrays = quantize_one(w, q.kind, name)
            assert detect(arrays)[name] == q
            feeds.update(arrays)
    return feeds


@pytest.fixture(scope="module")
def smollm_kept():
    """(config, weights) of the bundled SmolLM2 Q4_1 file loaded with its projections kept."""
    if SMOLLM is None:
        return None
    from lorac.runtime.model.gguf import load_gguf
    return load_gguf(SMOLLM, keep_quantized=True)


def smollm_case(kept):
    """A q_proj of the bundled SmolLM2 Q4_1 file, its rows of blocks as the loader keeps them."""
    name = "model.layers.2.self_attn.q_proj.weight"
    blocks = kept[f"{name}.Q4_1"]
    return ("smol", Quant("Q4_1"), blocks.shape[0], blocks.shape[1] // 20 * 32), {"smol.Q4_1": blocks}


@pytest.fixture(scope="module")
def graph(smollm_kept):
    """One graph: every case's dense weight (and a SmolLM2 projection's), and the fp16
    decoding of every bit pattern."""
    cases, feeds = list(CASES), case_arrays(np.random.default_rng(0))
    if smollm_kept:
        smol = smollm_case(smollm_kept[1])
        cases.append(smol[0])
        feeds.update(smol[1])
    g = GraphBuilder("dequant")
    for name, q, out, inp in cases:
        w = declare(g, q, name, out, inp)
        g.output(w.dense(g), f"{name}.dense")
    halves = g.input("halves", [65536, 2], ir.DataType.UINT8)
    g.output(f16(g, halves, 0), "f16")
    feeds["halves"] = np.arange(65536, dtype=np.uint16).view(np.uint8).reshape(65536, 2)
    return g.finish(), cases, feeds


def references(cases, feeds):
    out = {f"{name}.dense": dense_weight(feeds, name, q) for name, q, _, _ in cases}
    out["f16"] = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32).reshape(65536, 1)
    return out


def f16_expected(ref):
    """What the decoding gives: every finite pattern exactly, exponent 31 (inf, NaN) as +-inf."""
    bits = np.arange(65536, dtype=np.uint16).reshape(65536, 1)
    finite = (bits & 0x7C00) != 0x7C00
    return np.where(finite, ref, np.where(bits & 0x8000, -np.inf, np.inf)).astype(np.float32)


def test_ops_are_ones_both_runtimes_convert(graph):
    from tvm.relax.frontend.onnx.onnx_frontend import _get_convert_map
    model, _, _ = graph
    ops = {n.op_type for n in model.graph.node}
    assert {n.domain for n in model.graph.node} == {""}
    assert ops <= set(_get_convert_map()), ops - set(_get_convert_map())
    assert "BitShift" in ops and "Gather" in ops


def test_dense_emits_fresh_nodes_each_call():
    g = GraphBuilder("twice")
    w = declare(g, Quant("Q4_K"), "w", 2, 256)
    a, b = w.dense(g), w.dense(g)
    assert a is not b and len(g.inputs) == 1 and g.inputs[0].name == "w.Q4_K"


def test_onnxruntime_equals_the_references_bit_for_bit(graph):
    import onnxruntime as ort
    model, cases, feeds = graph
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in model.graph.output]
    got = dict(zip(names, sess.run(names, {i.name: feeds[i.name] for i in model.graph.input})))
    ref = references(cases, feeds)
    for name in names:
        want = f16_expected(ref[name]) if name == "f16" else ref[name]
        assert got[name].dtype == np.float32 and got[name].shape == want.shape, name
        assert np.array_equal(got[name].view(np.uint32), want.view(np.uint32)), name


def test_tvm_cpu_equals_the_references(graph, tmp_path_factory):
    assert_tvm_equals_the_references(graph, tmp_path_factory.mktemp("quant"), "cpu")


@pytest.mark.gpu  # skipped without a CUDA GPU (conftest.py)
def test_tvm_cuda_equals_the_references(graph, tmp_path_factory):
    assert_tvm_equals_the_references(graph, tmp_path_factory.mktemp("quant"), "cuda")


def assert_tvm_equals_the_references(graph, folder, target: str):
    from lorac.compiler import compile_graph
    from lorac.runtime.engine.artifact import load_artifact
    model, cases, feeds = graph
    art = compile_graph(model, target=target, out_dir=folder / target)
    got = load_artifact(art, device=target)({i.name: feeds[i.name] for i in model.graph.input})
    ref = references(cases, feeds)
    for name, want in ref.items():
        want = f16_expected(want) if name == "f16" else want
        have = np.asarray(got[name])
        assert have.dtype == np.float32 and have.shape == want.shape, name
        assert np.array_equal(have, want), name  # equal values (+0 == -0)
        nonzero = want != 0
        assert np.array_equal(have.view(np.uint32)[nonzero], want.view(np.uint32)[nonzero]), name


def test_float64_graphs_get_the_same_values_in_float64():
    import onnxruntime as ort
    g = GraphBuilder("f64", dtype=np.float64)
    w = np.random.default_rng(1).standard_normal((8, 64)).astype(np.float32)
    arrays = quantize_one(w, "int8", "w")
    g.output(declare(g, Quant("int8"), "w", 8, 64).dense(g), "dense")
    model = g.finish()
    got = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(["dense"], arrays)[0]
    assert got.dtype == np.float64 and np.array_equal(got, dense_weight(arrays, "w"))


@pytest.mark.parametrize("kind", ["nf4", "int8", "Q8_0"])
def test_training_graph_over_quantized_weights_equals_dense_on_dequantized(kind):
    """graphs/ops/linear.py reads a quantized weight through these emitters (TrainSpec.quant): the
    step's loss and LoRA gradients (onnxruntime) equal the dense graph's on the dequantized
    weights exactly."""
    import onnxruntime as ort
    from _compiler_graphs import SMALL_QWEN3, random_inputs
    from lorac.graphs import ALL_TARGETS, ModelSpec, TrainSpec, build_training_graph
    from lorac.runtime.model.quant import dequantize_weights, quantize_weights, target_names

    def run(model, feeds):
        sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        return dict(zip([o.name for o in model.graph.output], sess.run(None, {i.name: feeds[i.name] for i in model.graph.input})))

    config = dict(SMALL_QWEN3, hidden_size=64, intermediate_size=128, head_dim=16)
    spec = ModelSpec.from_hf_config(config)
    train = TrainSpec(batch=2, seq=8, rank=4, lora_targets=tuple(ALL_TARGETS))
    dense = build_training_graph(spec, train)
    weights = quantize_weights(random_inputs(dense, 0), kind, target_names(config))
    quant = tuple(sorted(detect(weights).items()))
    assert len(quant) == 14 and {q.kind for _, q in quant} == {kind}
    model = build_training_graph(spec, TrainSpec(batch=2, seq=8, rank=4, lora_targets=tuple(ALL_TARGETS), quant=quant))
    got, want = run(model, weights), run(dense, dequantize_weights(weights))
    assert set(got) == set(want) and all(np.array_equal(got[k], want[k]) for k in want)


@needs_smollm
def test_smollm_q4_1_blocks_kept_dequantize_to_the_dense_load(smollm_kept):
    """The bundled Q4_1 file: kept blocks (q/k rows reordered as blocks) dequantize, through
    gguf.quants, to exactly the weights the dense loader makes of the same tensors."""
    from lorac.graphs.families import llama
    from lorac.runtime.model import gguf_quant
    from lorac.runtime.model.gguf import open_gguf
    from lorac.runtime.model.quant import quantized_bytes, shape_of
    from lorac.runtime.model.quant import gguf_blocks
    config, kept = smollm_kept
    found = detect(kept)
    assert len(found) == 7 * config["num_hidden_layers"] and {q.kind for q in found.values()} == {"Q4_1"}
    assert "model.embed_tokens.weight" in kept and "model.layers.0.self_attn.q_proj.weight" not in kept
    tensors = {t.name: t for t in open_gguf(SMOLLM).tensors}
    for name, stem in (("model.layers.0.self_attn.q_proj.weight", "blk.0.attn_q.weight"),
                       ("model.layers.3.self_attn.k_proj.weight", "blk.3.attn_k.weight"),
                       ("model.layers.5.mlp.down_proj.weight", "blk.5.ffn_down.weight")):
        t = tensors[stem]
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))
        dense = llama.tensor_from_gguf(name, gguf_quant.dequantize(t.data, int(t.tensor_type), shape), config)
        w = gguf_blocks.dequantize(kept[f"{name}.Q4_1"], "Q4_1")
        assert np.array_equal(w.view(np.uint32), dense.view(np.uint32)), name
    assert quantized_bytes(kept) * 6 < 4 * sum(np.prod(shape_of(kept, n, q)) for n, q in found.items())
