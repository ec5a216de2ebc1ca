"""Gemma 2 (graphs/families/gemma2.py): sandwich (1 + w) norms, GeGLU, sqrt(D) embedding scale,
attention and final-logit soft-capping, sliding windows on alternate layers, head_dim != D/H."""
import pytest

pytest.importorskip("transformers")
from family_checks import checkpointing_matches_plain, exports, finite_differences, gguf_loading, hf_dir_loading, hf_parity  # noqa: E402

from lorac.graphs import ModelSpec, TrainSpec, build_training_graph  # noqa: E402

BASE = dict(model_type="gemma2", vocab_size=53, hidden_size=24, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=10, intermediate_size=37, sliding_window=4, query_pre_attn_scalar=7,
            attn_logit_softcapping=0.75, final_logit_softcapping=1.5, pad_token_id=0, eos_token_id=1, bos_token_id=2)
CASES = {  # name: (config changes, batch, seq, targets, rslora)
    "gqa2-caps-window-shorter-than-seq": ({}, 2, 7, None, False),
    "mha-odd-untied-no-caps": (dict(hidden_size=18, num_attention_heads=3, num_key_value_heads=3, head_dim=6,
                                    intermediate_size=23, tie_word_embeddings=False, attn_logit_softcapping=None,
                                    final_logit_softcapping=None, num_hidden_layers=2,
                                    layer_types=["full_attention", "sliding_attention"]), 3, 5, None, True),
    "gqa4-long": (dict(num_attention_heads=4, num_key_value_heads=1, sliding_window=3, attn_logit_softcapping=3.0,
                       final_logit_softcapping=30.0), 1, 11, ("q_proj", "o_proj", "up_proj", "down_proj"), False),
}


@pytest.mark.parametrize("name", list(CASES))
def test_grads_match_transformers(name):
    change, B, S, targets, rslora = CASES[name]
    hf_parity({**BASE, **change}, B, S, targets, rslora)


def test_checkpointing_matches_plain():
    checkpointing_matches_plain(BASE, 2, 6)


def test_finite_differences_float64():
    finite_differences({**BASE, "hidden_size": 8, "head_dim": 4, "intermediate_size": 9, "vocab_size": 19,
                        "num_hidden_layers": 2, "sliding_window": 2}, 2, 5)


def test_spec_units_and_refusals():
    spec = ModelSpec.from_hf_config({k: v for k, v in BASE.items() if "softcapping" not in k})
    assert (spec.attn_softcap, spec.logit_softcap) == (50.0, 30.0)  # HF's defaults when absent
    assert spec.sliding_layers == (0, 2) and spec.head_dim == 10 and spec.tied
    units = {f.name for f in build_training_graph(spec, TrainSpec(batch=1, seq=6)).functions}
    assert units == {"CausalAttentionSoftcapWindow", "CausalAttentionSoftcapWindowGrad", "CausalAttentionSoftcap",
                     "CausalAttentionSoftcapGrad"}
    with pytest.raises(ValueError, match="hidden_activation='gelu'"):
        ModelSpec.from_hf_config({**BASE, "hidden_activation": "gelu"})
    with pytest.raises(ValueError, match="layer_types must be 3 of"):
        ModelSpec.from_hf_config({**BASE, "layer_types": ["full_attention"]})


def test_hf_directory_and_gguf_loading(tmp_path):
    config, weights = hf_dir_loading(tmp_path, BASE)
    meta = {"block_count": 3, "embedding_length": 24, "feed_forward_length": 37, "attention.head_count": 4,
            "attention.head_count_kv": 2, "attention.key_length": 10, "attention.value_length": 10,
            "attention.layer_norm_rms_epsilon": 1e-6, "rope.freq_base": 10000.0, "context_length": 8192,
            "vocab_size": 53, "attention.sliding_window": 4, "attn_logit_softcapping": 0.75,
            "final_logit_softcapping": 1.5}
    # convert_hf_to_gguf stores Gemma's norm weights as 1 + w
    plus_one = lambda name, t: t + 1 if name.endswith("norm.weight") else t
    got = gguf_loading(tmp_path, "gemma2", weights, {**config, "query_pre_attn_scalar": 10}, meta, plus_one)
    assert got["architectures"] == ["Gemma2ForCausalLM"] and got["query_pre_attn_scalar"] == 10


def test_exports_in_peft_transformers_and_gguf(tmp_path):
    exports(tmp_path, BASE, "gemma2")
