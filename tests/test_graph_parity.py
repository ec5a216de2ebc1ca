"""Oracle 2: PyTorch autograd on HF transformers models with the same weights.

Every LoRA gradient is checked through the dense gradient of the adapted weight:
dA = s B^T dW_eff, dB = s dW_eff A^T. Shapes cover odd hidden sizes, GQA ratios 1/3/4,
untied heads, seq lengths that are not powers of two, ignored labels, all seven targets.
"""
import pytest

from lorac.graphs import ALL_TARGETS, ModelSpec, TrainSpec, build_training_graph
from oracles import assert_grads_match, batch, hf_model, hf_weights, random_lora, run_ort, torch_reference

pytest.importorskip("transformers")

CASES = {
    # name: (config, batch, seq, targets, rslora)
    "llama-odd-gqa3-untied": (dict(model_type="llama", vocab_size=61, hidden_size=33, num_hidden_layers=2,
                                   num_attention_heads=3, num_key_value_heads=1, head_dim=8, intermediate_size=45,
                                   tie_word_embeddings=False, rope_theta=500.0), 2, 7, ALL_TARGETS, False),
    "llama-mha-tied": (dict(model_type="llama", vocab_size=50, hidden_size=24, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=4, intermediate_size=37,
                            tie_word_embeddings=True), 3, 5, ("q_proj", "v_proj", "down_proj"), True),
    "llama-gqa4-bias": (dict(model_type="llama", vocab_size=40, hidden_size=32, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=1, intermediate_size=48,
                             attention_bias=True, tie_word_embeddings=False), 1, 11, ALL_TARGETS, False),
    "mistral-gqa3": (dict(model_type="mistral", vocab_size=45, hidden_size=36, num_hidden_layers=2,
                          num_attention_heads=6, num_key_value_heads=2, intermediate_size=50, sliding_window=64,
                          tie_word_embeddings=False), 2, 9, ALL_TARGETS, False),
    # the window (4) shorter than the sequence (9): HF's sliding-window mask, lorac's windowed unit
    "mistral-window": (dict(model_type="mistral", vocab_size=41, hidden_size=24, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, intermediate_size=30, sliding_window=4,
                            tie_word_embeddings=False), 2, 9, ALL_TARGETS, False),
    "qwen2-gqa3": (dict(model_type="qwen2", vocab_size=57, hidden_size=36, num_hidden_layers=2,
                        num_attention_heads=6, num_key_value_heads=2, intermediate_size=39,
                        tie_word_embeddings=True), 2, 6, ALL_TARGETS, False),
    "qwen2-mha-untied": (dict(model_type="qwen2", vocab_size=33, hidden_size=40, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=4, intermediate_size=27,
                              tie_word_embeddings=False), 3, 7, ("k_proj", "o_proj", "gate_proj", "up_proj"), True),
    "qwen2-gqa4": (dict(model_type="qwen2", vocab_size=48, hidden_size=48, num_hidden_layers=3,
                        num_attention_heads=8, num_key_value_heads=2, intermediate_size=61,
                        tie_word_embeddings=False), 1, 13, ALL_TARGETS, False),
    "qwen3-gqa3-tied": (dict(model_type="qwen3", vocab_size=67, hidden_size=30, num_hidden_layers=2,
                             num_attention_heads=6, num_key_value_heads=2, head_dim=10, intermediate_size=44,
                             tie_word_embeddings=True), 2, 7, ALL_TARGETS, False),
    "qwen3-odd-untied": (dict(model_type="qwen3", vocab_size=52, hidden_size=33, num_hidden_layers=2,
                              num_attention_heads=3, num_key_value_heads=3, head_dim=8, intermediate_size=41,
                              tie_word_embeddings=False), 3, 5, ("q_proj", "k_proj", "v_proj", "o_proj"), True),
    "qwen3-gqa3-long": (dict(model_type="qwen3", vocab_size=70, hidden_size=18, num_hidden_layers=3,
                             num_attention_heads=9, num_key_value_heads=3, head_dim=4, intermediate_size=29,
                             tie_word_embeddings=True), 1, 23, ALL_TARGETS, False),
}


@pytest.mark.parametrize("name", list(CASES))
def test_loss_and_lora_grads_match_pytorch(name):
    cfg, B, S, targets, rslora = CASES[name]
    spec = ModelSpec.from_hf_config(cfg)
    train = TrainSpec(batch=B, seq=S, lora_targets=tuple(targets), rank=4, alpha=8, rslora=rslora)
    model = hf_model(cfg)
    lora = random_lora(spec, train)
    ids, labels = batch(spec, train)
    assert (labels == -100).any()
    out = run_ort(build_training_graph(spec, train), {**hf_weights(model), **lora, "input_ids": ids, "labels": labels})
    assert_grads_match(out, *torch_reference(model, lora, ids, labels, train.scale))
