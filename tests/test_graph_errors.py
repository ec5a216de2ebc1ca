"""Bad specs fail up front with a ValueError that names the problem."""
import pytest

from lorac.graphs import ModelSpec, TrainSpec, build_training_graph

BASE = dict(model_type="qwen3", vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=4, intermediate_size=24)


@pytest.mark.parametrize("change,match", [
    (dict(model_type="gpt2"), "unsupported architecture model_type='gpt2'"),
    (dict(model_type=None), "unsupported architecture"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_scaling: rope_type='yarn'"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(mlp_bias=True), "mlp_bias"),
    (dict(num_key_value_heads=3), "not a multiple of num_key_value_heads=3"),
])
def test_model_spec_refuses(change, match):
    with pytest.raises(ValueError, match=match.replace("(", r"\(").replace("[", r"\[")):
        ModelSpec.from_hf_config({**BASE, **change})


@pytest.mark.parametrize("kw,match", [
    (dict(lora_targets=("q_proj", "fc1")), "fc1 not in a qwen3 model; valid targets: q_proj, k_proj"),
    (dict(rank=0), "rank must be > 0"),
    (dict(seq=1), "seq must be >= 2"),
    (dict(batch=0), "batch must be >= 1"),
    (dict(alpha=float("nan")), "alpha must be a finite positive number"),
    (dict(trained_layers=range(1, 5)), "trained_layers=range"),
    (dict(lora_targets=()), "lora_targets is empty"),
])
def test_train_spec_refuses(kw, match):
    spec = ModelSpec.from_hf_config(BASE)
    args = {"batch": 2, "seq": 4, **kw}
    with pytest.raises(ValueError, match=match):
        build_training_graph(spec, TrainSpec(**args))


def test_bad_sliding_windows_are_refused():
    with pytest.raises(ValueError, match="sliding_window=0 must be a positive integer"):
        ModelSpec.from_hf_config({**BASE, "model_type": "mistral", "sliding_window": 0})
    with pytest.raises(ValueError, match="use_sliding_window=True for qwen2"):
        ModelSpec.from_hf_config({**BASE, "model_type": "qwen2", "use_sliding_window": True, "sliding_window": 8})
