"""K-quant GGUF files (what the hub mostly holds): a Q4_K_M-style file made with the gguf
writer (Q4_K, with attn_v and ffn_down in Q6_K and one Q5_K tensor, norms F32) loads to the
same weights as `gguf.quants` gives and as transformers' own GGUF loader gives, and every
K-quant type dequantizes as gguf.quants does."""
import os

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import quants  # noqa: E402

from lorac.runtime.model import gguf_quant as gq  # noqa: E402
from lorac.runtime.model.gguf import load_gguf  # noqa: E402
from test_gguf import gguf_name, hf_weights, llama_cpp_permute, random_blocks, write_gguf  # noqa: E402

SHAPE = dict(hidden=256, heads=4, kv=2, head_dim=64, ffn=512, vocab=64)


def q4_k_m(name):
    """llama.cpp's Q4_K_M mix, simplified: Q6_K for attn_v and ffn_down, Q5_K for ffn_up."""
    if "v_proj" in name or "down_proj" in name:
        return "Q6_K"
    return "Q5_K" if "up_proj" in name else "Q4_K"


@pytest.mark.parametrize("name", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
def test_kquant_dequant_matches_gguf_quants(name):
    qt = gguf.GGMLQuantizationType[name]
    raw = random_blocks(qt, (3, 512), np.random.default_rng(0))
    ours = gq.dequantize(raw, int(qt), (3, 512))
    assert ours.dtype == np.float32 and ours.shape == (3, 512) and np.isfinite(ours).all()
    np.testing.assert_array_equal(ours, quants.dequantize(raw, qt))


@pytest.fixture(scope="module")
def q4_k_m_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("kq") / "tiny-Q4_K_M.gguf"
    w = hf_weights("llama", np.random.default_rng(3), **SHAPE)
    write_gguf(path, "llama", w, heads=4, kv=2, head_dim=64, qtype=q4_k_m)
    return path, w


def test_q4_k_m_loads_as_gguf_quants_dequantizes(q4_k_m_file):
    path, w = q4_k_m_file
    config, loaded = load_gguf(path)
    assert config["hidden_size"] == 256 and config["intermediate_size"] == 512
    assert set(loaded) == set(w)
    reader = gguf.GGUFReader(str(path))
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.0.attn_v.weight"] == "Q6_K" and types["blk.0.attn_q.weight"] == "Q4_K"
    assert types["blk.1.ffn_up.weight"] == "Q5_K" and types["blk.0.attn_norm.weight"] == "F32"
    for t in reader.tensors:
        name = next(k for k in w if gguf_name(k) == t.name)
        ref = quants.dequantize(t.data, t.tensor_type).reshape(w[name].shape)
        if name.endswith("q_proj.weight"):  # the loader undoes llama.cpp's RoPE row order
            np.testing.assert_array_equal(llama_cpp_permute(loaded[name], 4), ref, err_msg=name)
        elif name.endswith("k_proj.weight"):
            np.testing.assert_array_equal(llama_cpp_permute(loaded[name], 2), ref, err_msg=name)
        else:
            np.testing.assert_array_equal(loaded[name], ref, err_msg=name)


def test_q4_k_m_matches_transformers(q4_k_m_file):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    path, _ = q4_k_m_file
    _, loaded = load_gguf(path)
    ref = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=path.name,
                                                            dtype=torch.float32).state_dict()
    for name, x in loaded.items():
        np.testing.assert_array_equal(x, ref[name].numpy(), err_msg=name)
