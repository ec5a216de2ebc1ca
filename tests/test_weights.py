"""HF model directories: round trip through transformers' save_pretrained (fp32, fp16,
bf16, sharded), memory mapping, and one clear line for each kind of bad file."""

import json
import os
import struct

import numpy as np
import pytest

from lorac.runtime.errors import LoracError
from lorac.runtime.model.weights import load_hf_dir, load_model, load_safetensors, tensor_infos

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# transformers' bfloat16 -> float32 is exact, so every dtype compares bit for bit
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def tiny_model(kind="qwen3", tied=False, seed=0):
    torch.manual_seed(seed)
    common = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    if kind == "qwen3":
        return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=8, **common))
    if kind == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))


@pytest.mark.parametrize("kind,dtype,shard", [
    ("qwen3", "float32", False), ("qwen3", "bfloat16", True), ("llama", "float16", False),
    ("qwen2", "bfloat16", False), ("llama", "float32", True)])
def test_hf_round_trip(tmp_path, kind, dtype, shard):
    model = tiny_model(kind, tied=(kind == "llama")).to(DTYPES[dtype])
    model.save_pretrained(tmp_path, max_shard_size="40KB" if shard else "1GB")
    assert os.path.exists(tmp_path / ("model.safetensors.index.json" if shard else "model.safetensors"))
    config, weights = load_model(tmp_path)
    assert config["model_type"] == kind and config["hidden_size"] == 32
    state = {k: v for k, v in model.state_dict().items() if not (kind == "llama" and k == "lm_head.weight")}
    assert set(weights) >= set(state)
    for name, ref in state.items():
        assert weights[name].dtype == np.float32
        np.testing.assert_array_equal(weights[name], ref.float().numpy(), err_msg=name)
    # --compile-only sizes the step from the headers alone: what loading returns, unread
    assert {n: (i.dtype, i.size, i.nbytes) for n, i in tensor_infos(tmp_path).items()} == \
        {n: (a.dtype, a.size, a.nbytes) for n, a in weights.items()}


def test_requested_dtypes(tmp_path):
    tiny_model().to(torch.bfloat16).save_pretrained(tmp_path)
    _, bf = load_hf_dir(tmp_path, "bfloat16")
    _, f16 = load_hf_dir(tmp_path, np.float16)
    _, f32 = load_hf_dir(tmp_path)
    w = "model.layers.0.self_attn.q_proj.weight"
    assert bf[w].dtype.name == "bfloat16" and f16[w].dtype == np.float16
    np.testing.assert_array_equal(bf[w].astype(np.float32), f32[w])


def test_float32_is_memory_mapped(tmp_path):
    tiny_model().save_pretrained(tmp_path)
    _, weights = load_hf_dir(tmp_path)
    w = weights["model.embed_tokens.weight"]
    assert not w.flags.writeable and isinstance(w.base, np.ndarray)  # a view of the mapped file


# ---------------------------------------------------------------- bad input

def write_safetensors(path, header, data=b""):
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def test_corrupt_files(tmp_path):
    p = tmp_path / "x.safetensors"
    p.write_bytes(b"\x01\x02")
    with pytest.raises(LoracError, match=r"corrupt safetensors file \(header too small\)"):
        load_safetensors(p)
    p.write_bytes(struct.pack("<Q", 10_000) + b"{}")
    with pytest.raises(LoracError, match=r"corrupt safetensors file \(invalid header length\)"):
        load_safetensors(p)
    p.write_bytes(struct.pack("<Q", 4) + b"{{{{")
    with pytest.raises(LoracError, match=r"corrupt safetensors file \(invalid JSON in header"):
        load_safetensors(p)
    write_safetensors(p, {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8)
    with pytest.raises(LoracError, match=r"corrupt safetensors file \(incomplete metadata, file not fully covered\)"):
        load_safetensors(p)
    write_safetensors(p, {"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 16]}}, b"\0" * 16)
    with pytest.raises(LoracError, match="invalid shape, data type, or offset for tensor"):
        load_safetensors(p)
    write_safetensors(p, {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                          "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}, b"\0" * 16)
    with pytest.raises(LoracError, match="invalid offset for tensor `b`"):
        load_safetensors(p)
    write_safetensors(p, {"a": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}, b"\0" * 8)
    with pytest.raises(LoracError, match="unsupported dtype C64"):
        load_safetensors(p)


def test_truncated_real_file(tmp_path):
    tiny_model().save_pretrained(tmp_path)
    f = tmp_path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(LoracError, match="corrupt safetensors file .incomplete metadata, file not fully covered"):
        load_model(tmp_path)


def test_missing_pieces(tmp_path):
    with pytest.raises(LoracError, match="model directory not found"):
        load_model(tmp_path / "nope")
    with pytest.raises(LoracError, match="no config.json"):
        load_model(tmp_path)
    model = tiny_model()
    model.save_pretrained(tmp_path)
    os.rename(tmp_path / "model.safetensors", tmp_path / "elsewhere.safetensors")
    with pytest.raises(LoracError, match="no model.safetensors"):
        load_model(tmp_path)

    from safetensors.numpy import save_file
    state = {k: v.numpy() for k, v in model.state_dict().items() if "layers.1.mlp.up_proj" not in k}
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(LoracError, match=r"tensor model\.layers\.1\.mlp\.up_proj\.weight is missing"):
        load_model(tmp_path)


def test_missing_shard(tmp_path):
    tiny_model().save_pretrained(tmp_path, max_shard_size="40KB")
    shard = sorted(n for n in os.listdir(tmp_path) if n.startswith("model-"))[0]
    os.remove(tmp_path / shard)
    with pytest.raises(LoracError, match=f"shard {shard} is missing"):
        load_model(tmp_path)


def test_wrong_kind_of_path(tmp_path):
    (tmp_path / "w.bin").write_bytes(b"x")
    with pytest.raises(LoracError, match="expected an HF model directory or a .gguf file"):
        load_model(tmp_path / "w.bin")
