"""Phi-3 (graphs/families/phi3.py): fused qkv_proj and gate_up_proj, LoRA on the fused matrices."""
import pytest

pytest.importorskip("transformers")
from family_checks import checkpointing_matches_plain, exports, finite_differences, gguf_loading, hf_dir_loading, hf_parity  # noqa: E402

from lorac.graphs import ModelSpec, TrainSpec, build_training_graph  # noqa: E402

BASE = dict(model_type="phi3", vocab_size=53, hidden_size=36, num_hidden_layers=2, num_attention_heads=6,
            num_key_value_heads=2, intermediate_size=37, tie_word_embeddings=False, pad_token_id=0, eos_token_id=1)
CASES = {  # name: (config changes, batch, seq, targets, rslora)
    "gqa3-window-shorter-than-seq": (dict(sliding_window=5), 2, 7, None, False),
    "mha-odd-tied": (dict(hidden_size=30, num_attention_heads=3, num_key_value_heads=3, intermediate_size=23,
                          tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 500.0}),
                     3, 5, None, True),
    "gqa4-fused-only": (dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=1, num_hidden_layers=3),
                        1, 11, ("qkv_proj", "gate_up_proj"), False),
}


@pytest.mark.parametrize("name", list(CASES))
def test_grads_match_transformers(name):
    change, B, S, targets, rslora = CASES[name]
    hf_parity({**BASE, **change}, B, S, targets, rslora)


def test_checkpointing_matches_plain():
    checkpointing_matches_plain(BASE, 2, 6)


def test_finite_differences_float64():
    finite_differences({**BASE, "hidden_size": 12, "num_attention_heads": 3, "num_key_value_heads": 1,
                        "intermediate_size": 9, "vocab_size": 19, "sliding_window": 3}, 2, 5)


def test_spec_and_refusals():
    spec = ModelSpec.from_hf_config({**BASE, "sliding_window": 2047})
    assert spec.targets == ("qkv_proj", "o_proj", "gate_up_proj", "down_proj") and not spec.tied
    assert spec.proj_shape("qkv_proj") == ((6 + 2 * 2) * 6, 36) and spec.proj_shape("gate_up_proj") == (74, 36)
    assert spec.sliding_window == 2047 and spec.rms_eps == 1e-5
    with pytest.raises(ValueError, match="LoRA target.* q_proj not in a phi3 model; valid targets: qkv_proj"):
        build_training_graph(spec, TrainSpec(batch=1, seq=4, lora_targets=("q_proj",)))
    with pytest.raises(ValueError, match="rope_type='longrope'"):
        ModelSpec.from_hf_config({**BASE, "rope_scaling": {"rope_type": "longrope"}})
    with pytest.raises(ValueError, match="partial_rotary_factor=0.75"):
        ModelSpec.from_hf_config({**BASE, "partial_rotary_factor": 0.75})


def test_hf_directory_and_gguf_loading(tmp_path):
    config, weights = hf_dir_loading(tmp_path, {**BASE, "sliding_window": 6})
    meta = {"block_count": 2, "embedding_length": 36, "feed_forward_length": 37, "attention.head_count": 6,
            "attention.head_count_kv": 2, "attention.layer_norm_rms_epsilon": 1e-5, "rope.freq_base": 10000.0,
            "context_length": 4096, "vocab_size": 53, "rope.dimension_count": 6, "attention.sliding_window": 6}
    got = gguf_loading(tmp_path, "phi3", weights, config, meta)
    assert got["architectures"] == ["Phi3ForCausalLM"] and got["sliding_window"] == 6


def test_exports_in_peft_transformers_and_gguf(tmp_path):
    exports(tmp_path, BASE, "phi3")
