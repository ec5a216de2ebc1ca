"""Tiny Mamba-1 training graphs through lorac.compiler (ONNX -> TVM Relax -> llvm artifact, the
selective scan on lorac's own CPU kernels): the compiled step agrees with onnxruntime running
the same graph (the scan units' chunked bodies) and with HF MambaForCausalLM's autograd."""
import numpy as np
import pytest

from lorac.graphs import ModelSpec, TrainSpec, build_training_graph
from lorac.graphs.mamba_spec import MAMBA_TARGETS
from oracles import rel_err, run_ort
from test_mamba_parity import feeds

pytest.importorskip("tvm")


def test_cpu_artifact_matches_onnxruntime(tmp_path):
    from lorac.compiler import compile_graph
    from lorac.runtime.engine.artifact import load_artifact
    cfg = dict(model_type="mamba", vocab_size=31, hidden_size=12, state_size=4, num_hidden_layers=2, expand=2,
               conv_kernel=4, tie_word_embeddings=True)
    spec = ModelSpec.from_hf_config(cfg)
    # seq 7 with chunk 3: three chunks, the last one padded; checkpointing re-emits the forward
    train = TrainSpec(batch=2, seq=7, lora_targets=MAMBA_TARGETS, rank=3, alpha=6, checkpointing=True,
                      extra={"scan_chunk": 3})
    model = build_training_graph(spec, train)
    f = feeds(cfg, spec, train)
    step = load_artifact(compile_graph(model, target="cpu", out_dir=tmp_path / "art"), device="cpu")
    wanted = {i.name for i in model.graph.input}
    out = step({k: v for k, v in f.items() if k in wanted})
    ref = run_ort(model, f)
    assert set(out) == set(ref)
    for k, v in ref.items():
        assert np.isfinite(out[k]).all() and rel_err(out[k], v) <= 1e-5, k


@pytest.mark.parametrize("name,chunk", [("tied-3layers-chunk5", 5), ("odd-hidden-tied-chunk3", 16)])
def test_cpu_artifact_matches_pytorch(name, chunk, tmp_path):
    """The compiled CPU step (the scan on lorac's kernels) against HF MambaForCausalLM's
    autograd: state 8 with seq 12 in chunks of 5; state 5 with seq 7 in one chunk of 16 (the
    CPU default length)."""
    pytest.importorskip("transformers")
    from lorac.compiler import compile_graph
    from lorac.runtime.engine.artifact import load_artifact
    from mamba_oracles import hf_mamba
    from oracles import assert_grads_match, batch, hf_weights, random_lora, torch_reference
    from test_mamba_parity import CASES

    cfg, B, S, _, targets, rslora = CASES[name]
    spec = ModelSpec.from_hf_config(cfg)
    train = TrainSpec(batch=B, seq=S, lora_targets=tuple(targets), rank=3, alpha=6, rslora=rslora,
                      extra={"scan_chunk": chunk})
    model, hf = build_training_graph(spec, train), hf_mamba(cfg)
    lora = random_lora(spec, train)
    ids, labels = batch(spec, train)
    step = load_artifact(compile_graph(model, target="cpu", out_dir=tmp_path / "art"), device="cpu")
    out = step({**hf_weights(hf), **lora, "input_ids": ids, "labels": labels})
    assert_grads_match(out, *torch_reference(hf, lora, ids, labels, train.scale), min_norm=1e-6)
