"""Quantized embeddings (`--quantize-embeddings`): the input embedding's lookup and a quantized LM
head read in vocabulary slices (graphs/ops/quant.py QuantWeight.rows / row_slice, graphs/ops/loss.py),
against the dense graphs fed the reference dequantization of the same tables (fp32 on the CPU:
loss, every LoRA gradient, the eval loss and the logits within 1e-5). Through onnxruntime for
every family (Gemma 2's embedding scale and final soft-cap, Phi-3, Mamba), through TVM's CPU
artifacts and onnxruntime's engine for the Qwen3 decoder; then `lorac train` over an NF4 base with
NF4 tables, `lorac eval` and the merged export of its checkpoint, and the flag's one-line errors.
The unit-level checks (slices, bytes, the plan's choice) are tests/test_embeddings_quant.py."""
from __future__ import annotations

import json

import numpy as np
import pytest

from tiny_model import make_corpus, make_model_dir

B, S = 2, 16
QWEN3 = dict(model_type="qwen3", vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)
GEMMA2 = dict(model_type="gemma2", vocab_size=53, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, intermediate_size=96, sliding_window=4, query_pre_attn_scalar=16,
              attn_logit_softcapping=5.0, final_logit_softcapping=1.5, pad_token_id=0, eos_token_id=1, bos_token_id=2)
PHI3 = dict(model_type="phi3", vocab_size=53, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=96, tie_word_embeddings=False, pad_token_id=0, eos_token_id=1)
MAMBA = dict(model_type="mamba", vocab_size=41, hidden_size=64, state_size=4, num_hidden_layers=2, expand=2,
             conv_kernel=4, tie_word_embeddings=True)
# name: (config, tables, layers); the head read in 3 vocabulary slices, the 32 tokens in 2 loss chunks
CASES = {
    "qwen3-untied-nf4-nf4layers": (QWEN3, "nf4", "nf4"),
    "qwen3-tied-int8-int8layers": ({**QWEN3, "tie_word_embeddings": True}, "int8", "int8"),
    "qwen3-untied-int8-dense-layers": (QWEN3, "int8", None),
    "gemma2-tied-nf4-scale-softcap": (GEMMA2, "nf4", "nf4"),
    "phi3-untied-nf4": (PHI3, "nf4", "int8"),
    "mamba-tied-nf4": (MAMBA, "nf4", "nf4"),
    "mamba-untied-int8": ({**MAMBA, "tie_word_embeddings": False}, "int8", None),
    # GGUF rows of blocks read by rows too (graphs only: the runtime quantizes tables as nf4 or int8)
    "qwen3-untied-q8_0-api": (QWEN3, "Q8_0", "nf4"),
}


def _train(spec, quant=(), **kw):
    from lorac.graphs import TrainSpec
    return TrainSpec(batch=B, seq=S, lora_targets=tuple(spec.targets), rank=4, alpha=8.0, quant=quant, head_slices=3,
                     loss_chunk=16, **kw)


def _random_weights(model, vocab: int, rng) -> dict:
    """Every input of a dense graph (tests/_compiler_graphs.random_inputs), three labels ignored."""
    from _compiler_graphs import random_inputs
    return random_inputs(model, vocab=vocab, rng=rng, ignored=3)


def _quantized(config, spec, dense: dict, tables: str, layers):
    """`dense` with the LoRA targets' weights quantized as `layers` (nf4: double-quantized absmax, as
    --quantize) and the embedding tables as `tables` (the run's quantize_tables), and its TrainSpec.quant."""
    from lorac.graphs.ops.quant import Quant, detect
    from lorac.runtime.model.quant import quantize_weights, target_names
    from lorac.runtime.model.quant.embeddings import KINDS, held, quantize_tables, tables as names
    weights = quantize_weights(dense, layers, target_names(config)) if layers else dict(dense)
    quant = held(spec, _train(spec), tables).quant if tables in KINDS else [(n, Quant(tables)) for n in names(spec)]
    weights = quantize_tables(weights, quant)
    return weights, tuple(sorted(detect(weights).items()))


def _close(got: dict, want: dict, what: str):
    assert set(got) == set(want), what
    for k in want:
        a, b = np.asarray(got[k], np.float32), np.asarray(want[k], np.float32)
        assert a.shape == b.shape and np.abs(a - b).max() <= 1e-5 * (np.abs(b).max() + 1e-12), (what, k)


@pytest.mark.parametrize("case", list(CASES))
def test_graphs_over_quantized_tables_equal_the_dense_graphs_on_their_dequantization(case):
    """Training, eval and forward graphs (onnxruntime, CPU EP, fp32)."""
    import onnxruntime as ort

    from lorac.graphs import ModelSpec, build_eval_graph, build_forward_graph, build_training_graph
    from lorac.runtime.model.quant import dequantize_weights
    config, tables, layers = CASES[case]
    spec = ModelSpec.from_hf_config(config)

    def run(model, feeds):
        sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        names = [o.name for o in model.graph.output]
        return dict(zip(names, sess.run(names, {i.name: feeds[i.name] for i in model.graph.input})))

    dense_train = build_training_graph(spec, _train(spec))
    weights, quant = _quantized(config, spec, _random_weights(dense_train, spec.vocab, np.random.default_rng(0)), tables,
                                layers)
    assert ("model.embed_tokens.weight" in dict(quant)) or ("backbone.embeddings.weight" in dict(quant))
    reference = dequantize_weights(weights)
    for build in (build_training_graph, build_eval_graph, build_forward_graph):
        got = run(build(spec, _train(spec, quant)), weights)
        _close(got, run(build(spec, _train(spec)), reference), f"{case} {build.__name__}")


@pytest.mark.parametrize("backend,tied,tables,layers", [("tvm", False, "nf4", "nf4"), ("ort", True, "int8", "int8")])
def test_engine_step_eval_and_logits_equal_the_dense_engine(tmp_path, backend, tied, tables, layers):
    """A transformers-written tiny Qwen3 (hidden 64): the quantized step (loss, every LoRA gradient),
    the eval loss and the generation logits of lorac's engines (TVM's compiled CPU artifacts; the
    onnxruntime engine, which feeds the blocks as they are) equal the dense onnxruntime engine's on
    the reference dequantization (fp32 both)."""
    from lorac.runtime.engine import make_engine
    from lorac.runtime.model.quant import dequantize_weights
    from lorac.graphs import ModelSpec
    from lorac.runtime.model.weights import load_model
    config, dense = load_model(make_model_dir(tmp_path / "m", hidden_size=64, intermediate_size=128, head_dim=16,
                                              tie_word_embeddings=tied))
    spec = ModelSpec.from_hf_config(config)
    weights, quant = _quantized(config, spec, dense, tables, layers)
    mk = lambda b, w, q: make_engine(b, spec, _train(spec, q), w, "cpu", cache_dir=tmp_path / "cache", log=print)  # noqa: E731
    eq, ed = mk(backend, weights, quant), mk("ort", dequantize_weights(weights), ())
    rng = np.random.default_rng(1)
    lora = {n: (0.05 * rng.standard_normal(s)).astype(np.float32) for n, s in eq.shapes.items()}
    ids = rng.integers(4, spec.vocab, (B, S)).astype(np.int64)
    got = []
    for eng in (eq, ed):
        zeros = {n: np.zeros(s, np.float32) for n, s in eng.shapes.items()}
        eng.set_state(lora, zeros, dict(zeros))
        out = eng.step({"input_ids": ids, "labels": ids}, eng.lora)
        logits = eng.logits(ids[:1, :8], eng.lora)
        got.append({"loss": np.float32(out.pop("loss")), **eng.host(out),
                    "eval": np.float32(eng.eval_loss({"input_ids": ids, "labels": ids}, eng.lora)),
                    "logits": logits.numpy() if hasattr(logits, "numpy") else np.asarray(logits)})
    _close(got[0], got[1], f"{backend} engine")


def test_lorac_train_with_nf4_tables_then_eval_generate_and_merged_export(tmp_path):
    """`lorac train --quantize-embeddings nf4` on the CPU (dense layers here; the tables beside
    quantized layers: the graph and engine tests above): the run says what the tables take, learns
    (its eval graph reads the tables too), records the setting; `lorac eval` and `generate` of the
    checkpoint run (over the dense base, as for any quantized run: onnxruntime here, no compile)
    and the merged export writes the base file's own tables."""
    from safetensors.numpy import load_file

    from conftest import run_lorac
    model = make_model_dir(tmp_path / "m", hidden_size=64, intermediate_size=128, head_dim=16, tie_word_embeddings=False)
    corpus = make_corpus(tmp_path / "corpus.txt", 120)
    out, cache = tmp_path / "run", str(tmp_path / "cache")
    r = run_lorac(["train", "--model", str(model), "--data", str(corpus), "--quantize-embeddings", "nf4", "--steps", "8",
                   "--batch", "2", "--seq", "32", "--out", str(out), "--eval-every", "8",
                   "--sample-tokens", "0", "--cache-dir", cache])
    assert r.returncode == 0, r.stderr[-2000:]
    assert "embeddings: model.embed_tokens.weight and lm_head.weight held as nf4:" in r.stderr
    assert "(of which embeddings 0.0 GB)" in r.stderr
    summary = json.loads(r.stdout)
    assert summary["eval_loss_after"] < summary["eval_loss_before"] - 0.1
    state = json.loads(next((out / "checkpoints").glob("ckpt-*/state.json")).read_text())
    assert state["train_config"]["quantize_embeddings"] == "nf4"
    r = run_lorac(["eval", "--checkpoint", str(out / "checkpoints"), "--data", str(corpus), "--backend", "ort"])
    assert r.returncode == 0 and json.loads(r.stdout)["eval_loss"] > 0, r.stderr[-2000:]
    r = run_lorac(["generate", "--checkpoint", str(out / "checkpoints"), "--prompt", "hi", "--max-new-tokens", "3",
                   "--backend", "ort"])
    assert r.returncode == 0, r.stderr[-2000:]
    r = run_lorac(["export", "--checkpoint", str(out / "checkpoints"), "--format", "merged", "--out",
                   str(tmp_path / "merged"), "--dtype", "float32"])
    assert r.returncode == 0, r.stderr[-2000:]
    merged, base = load_file(tmp_path / "merged" / "model.safetensors"), load_file(model / "model.safetensors")
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        assert np.array_equal(merged[name], base[name]), name


def test_quantize_embeddings_errors_are_one_line(tmp_path):
    from conftest import run_lorac
    narrow = make_model_dir(tmp_path / "m48")  # hidden 48: no whole NF4 blocks a row
    for args, msg in ((["--quantize-embeddings", "fp8"], "--quantize-embeddings must be auto, off, nf4, int8, got 'fp8'"),
                      (["--quantize-embeddings", "int8", "--dequantize"], "cannot be combined with --dequantize"),
                      (["--model", str(narrow), "--quantize-embeddings", "nf4"],
                       "--quantize-embeddings nf4: hidden size 48 (tensor model.embed_tokens.weight: nf4 rows of 48")):
        r = run_lorac(["train", "--out", str(tmp_path / "o"), "--steps", "1", *args])
        lines = r.stderr.strip().splitlines()
        assert r.returncode != 0 and "Traceback" not in r.stderr and lines[-1].startswith("lorac: "), r.stderr
        assert msg in lines[-1] and lines[:-1] == ([f"model: {narrow} ({narrow})"] if "--model" in args else []), lines
