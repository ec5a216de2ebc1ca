"""A tiny Mamba-1 training graph through lorac.compiler (ONNX -> TVM Relax -> llvm artifact):
the chunked scan's ops (CumSum, Where, Split, Pad, Softplus, 6-D broadcasts) import and the
compiled step agrees with onnxruntime on the same graph."""
import numpy as np
import pytest

from lorac.graphs import ModelSpec, TrainSpec, build_training_graph
from lorac.graphs.mamba_spec import MAMBA_TARGETS
from oracles import rel_err, run_ort
from test_mamba_parity import feeds

pytest.importorskip("tvm")


def test_cpu_artifact_matches_onnxruntime(tmp_path):
    from lorac.compiler import compile_graph
    from lorac.runtime.artifact import load_artifact
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
