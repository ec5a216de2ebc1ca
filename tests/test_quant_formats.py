"""Quantized frozen weights (runtime/model/quant, graphs/ops/quant.py's layout), without compiling:
the GGUF reference against gguf.quants (random blocks), NF4's
layout and error bounds, int8, the dict-level helpers, and the loaders' keep/quantize
options. bitsandbytes' own comparisons need torch: tests/test_quant_bnb.py; the ONNX
emitters and the bundled SmolLM2 file's blocks: tests/test_quant_graphs.py."""
from __future__ import annotations

import json

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from lorac.core.errors import LoracError  # noqa: E402
from lorac.graphs.ops.quant import GGUF_BLOCKS, Quant, detect, quant_inputs  # noqa: E402
from lorac.runtime.model import gguf_quant  # noqa: E402
from lorac.runtime.model.quant import dequantize_weights, quantize_targets, quantize_weights, quantized_bytes, shape_of
from lorac.runtime.model.quant import gguf_blocks
from lorac.runtime.model.quant import int8
from lorac.runtime.model.quant import nf4
from test_gguf import hf_weights, write_gguf  # noqa: E402

LINEAR = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
          "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def finite_blocks(kind, out, inp, rng):
    """Random blocks of `kind` whose fp16 scales are random finite fp16 bit patterns (subnormals,
    huge values and both signs included)."""
    qk, nbytes = GGUF_BLOCKS[kind]
    raw = rng.integers(0, 256, (out, inp // qk, nbytes), dtype=np.uint8)
    for at in gguf_blocks.SCALES[kind]:
        hi = raw[..., at + 1]
        hi[(hi & 0x7C) == 0x7C] ^= 0x04  # exponent 31 (inf, NaN) becomes 30
    return raw.reshape(out, -1)


# ------------------------------------------------------------------ GGUF blocks

def test_block_sizes_are_gguf_constants():
    assert GGUF_BLOCKS == {k: tuple(gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[k]]) for k in GGUF_BLOCKS}


@pytest.mark.parametrize("kind", sorted(GGUF_BLOCKS))
def test_gguf_reference_is_gguf_quants(kind):
    raw = finite_blocks(kind, 6, 512, np.random.default_rng(1))
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind])
    ours = gguf_blocks.dequantize(raw, kind, 512)
    assert ours.dtype == np.float32 and ours.shape == (6, 512) and np.isfinite(ours).all()
    assert np.array_equal(ours.view(np.uint32), ref.view(np.uint32))
    # lorac's own dense path (gguf_quant.py) agrees bit for bit too
    dense = gguf_quant.dequantize(raw, int(gguf.GGMLQuantizationType[kind]), (6, 512))
    assert np.array_equal(dense.view(np.uint32), ours.view(np.uint32))


def test_gguf_blocks_refuse_partial_rows_and_non_finite_scales():
    raw = finite_blocks("Q4_K", 3, 256, np.random.default_rng(0))
    with pytest.raises(LoracError, match=r"GGUF tensor blk.0.attn_q.weight: Q4_K data of 432 bytes does not hold 3 rows of 512"):
        gguf_blocks.blocks_of(raw, "Q4_K", 3, 512, "blk.0.attn_q.weight")
    raw[1, 1] = 0x7C  # block 1's d: exponent 31 (inf)
    with pytest.raises(LoracError, match=r"^GGUF tensor t: block 1 has a non-finite fp16 scale \(corrupt Q4_K data\)$"):
        gguf_blocks.blocks_of(raw, "Q4_K", 3, 256, "t")
    with pytest.raises(LoracError, match=r"^tensor w: has non-finite values; cannot quantize it to Q4_K$"):
        gguf_blocks.quantize(np.full((2, 256), np.nan, np.float32), "Q4_K", "w")


# ------------------------------------------------------------------ nf4

def test_nf4_code_and_packing():
    """Values on the NF4 grid come back exactly; the first element of a pair is the high nibble."""
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 16, (5, 128))
    codes[:, ::64] = 15  # every 64-block holds code 1.0, so absmax is the block's scale
    scale = rng.uniform(0.5, 2, (5 * 128 // 64, 1)).astype(np.float32)
    w = (nf4.NF4_CODE[codes].reshape(-1, 64) * scale).reshape(5, 128)
    a = nf4.quantize(w, double=False)
    assert a["nf4"].shape == (5, 64) and a["nf4"].dtype == np.uint8
    assert np.array_equal(a["nf4"], (codes[:, 0::2] << 4 | codes[:, 1::2]).astype(np.uint8))
    assert np.array_equal(a["absmax"], scale[:, 0])
    assert np.array_equal(nf4.dequantize(a, 5, 128), w)


@pytest.mark.parametrize("double", [False, True])
def test_nf4_error_is_bounded_by_half_the_widest_code_gap(double):
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((40, 96)) * rng.uniform(0.01, 3, (40, 1))).astype(np.float32)  # 60 blocks
    a = nf4.quantize(w, block=64, double=double)
    assert set(a) == {"nf4", "nf4_code", *(("absmax_q", "absmax_code", "absmax_scale", "absmax_offset") if double else ("absmax",))}
    back = nf4.dequantize(a, 40, 96)
    absmax = np.abs(w.reshape(-1, 64)).max(1)
    gap = np.diff(nf4.NF4_CODE).max() / 2
    bound = absmax * gap * (1.01 if double else 1.0) + (0.02 * absmax.max() if double else 0)
    assert (np.abs(back - w).reshape(-1, 64).max(1) <= bound + 1e-7).all()
    if double:  # the absmax itself: 8-bit dynamic code, block 256
        err = np.abs(nf4.absmax_of(a) - absmax)
        assert err.max() <= 0.01 * np.abs(absmax - absmax.mean()).max()


def test_nf4_dynamic_map_is_bnbs_table():
    m = nf4.dynamic_map()
    assert m.shape == (256,) and m.dtype == np.float32 and (np.diff(m) > 0).all()
    assert m[-1] == 1.0 and 0.0 in m and abs(m[0] + 0.99297) < 1e-5


def test_nf4_shape_errors_name_the_tensor():
    with pytest.raises(LoracError, match=r"tensor x: nf4 needs 3x20 values to be whole blocks of 64"):
        nf4.quantize(np.ones((3, 20), np.float32), name="x")
    with pytest.raises(LoracError, match="nf4 block size 48"):
        Quant("nf4", 48)
    with pytest.raises(LoracError, match=r"quantization 'Q3_K' is not supported"):
        Quant("Q3_K")
    with pytest.raises(LoracError, match=r"tensor w: Q4_K needs rows of whole 256-value blocks, not 96"):
        quant_inputs(Quant("Q4_K"), "w", 4, 96)
    with pytest.raises(LoracError, match="non-finite"):
        nf4.quantize(np.full((2, 64), np.nan, np.float32), name="w")


def to_bnb(arrays: dict, name: str, shape, dtype="float16") -> dict:
    """lorac's nf4 arrays as bitsandbytes saves them (QuantState.as_dict(packed=True))."""
    state = {"quant_type": "nf4", "blocksize": int(np.prod(shape)) // nf4.absmax_of(arrays).size,
             "dtype": dtype, "shape": list(shape)}
    out = {name: arrays["nf4"].reshape(-1, 1), f"{name}.quant_map": arrays["nf4_code"]}
    if "absmax" in arrays:
        out[f"{name}.absmax"] = arrays["absmax"]
    else:
        out.update({f"{name}.absmax": arrays["absmax_q"], f"{name}.nested_absmax": arrays["absmax_scale"],
                    f"{name}.nested_quant_map": arrays["absmax_code"]})
        state.update(nested_blocksize=256, nested_dtype="float32", nested_offset=float(arrays["absmax_offset"][0]))
    out[f"{name}.quant_state.bitsandbytes__nf4"] = np.frombuffer(json.dumps(state).encode(), np.uint8).copy()
    return out


@pytest.mark.parametrize("double", [False, True])
def test_from_bnb_reads_what_bnb_saves(double):
    w = np.random.default_rng(2).standard_normal((48, 64)).astype(np.float32)
    a = nf4.quantize(w, double=double)
    got, shape = nf4.from_bnb(to_bnb(a, "m.w", (48, 64)), "m.w")
    assert shape == (48, 64) and set(got) == set(a)
    assert all(np.array_equal(got[k], a[k]) for k in a)


def test_from_bnb_errors_are_one_line_naming_the_tensor():
    w = np.random.default_rng(3).standard_normal((8, 64)).astype(np.float32)
    plain, nested = to_bnb(nf4.quantize(w, double=False), "w", (8, 64)), to_bnb(nf4.quantize(w), "w", (8, 64))
    fp4 = {k.replace("__nf4", "__fp4"): v for k, v in plain.items()}
    with pytest.raises(LoracError, match=r"^tensor w: bitsandbytes quant type 'fp4' is not supported \(only nf4\)$"):
        nf4.from_bnb(fp4, "w")
    for bad in (np.nan, -1.0, np.inf):
        t = dict(plain, **{"w.absmax": np.array([1.0, bad] + [1.0] * 6, np.float32)})
        with pytest.raises(LoracError, match=r"^tensor w: corrupt absmax \(block 1 holds .*non-finite or negative\)$"):
            nf4.from_bnb(t, "w")
    t = dict(nested, **{"w.nested_absmax": np.array([-2.0], np.float32)})
    with pytest.raises(LoracError, match=r"^tensor w: corrupt nested_absmax"):
        nf4.from_bnb(t, "w")
    t = dict(plain, **{"w.absmax": np.ones(7, np.float32)})  # 7 blocks for 512 values
    with pytest.raises(LoracError, match=r"^tensor w.absmax: float32 of 7 values where float32 of 8 are expected"):
        nf4.from_bnb(t, "w")
    state = json.loads(plain["w.quant_state.bitsandbytes__nf4"].tobytes())
    for field, value, match in (("blocksize", 48, "blocksize 48 does not fit shape"),
                                ("quant_type", "fp4", "quant_type 'fp4' is not supported"),
                                ("shape", [512], "shape \\[512\\] is not a 2-D weight shape")):
        t = dict(plain, **{"w.quant_state.bitsandbytes__nf4": np.frombuffer(json.dumps({**state, field: value}).encode(), np.uint8)})
        with pytest.raises(LoracError, match=match):
            nf4.from_bnb(t, "w")
    with pytest.raises(LoracError, match=r"bitsandbytes tensor w.quant_map is missing"):
        nf4.from_bnb({k: v for k, v in plain.items() if k != "w.quant_map"}, "w")


# ------------------------------------------------------------------ int8

def test_int8_round_trip_and_zero_rows():
    rng = np.random.default_rng(4)
    w = (rng.standard_normal((7, 33)) * rng.uniform(0.01, 5, (7, 1))).astype(np.float32)
    w[3] = 0.0
    a = int8.quantize(w)
    assert a["int8"].dtype == np.int8 and a["int8_scale"].dtype == np.float32
    assert a["int8_scale"][3] == 1.0 and not a["int8"][3].any()
    assert np.abs(a["int8"]).max() == 127 and a["int8"].min() >= -127
    back = int8.dequantize(a)
    assert (np.abs(back - w) <= a["int8_scale"][:, None] / 2 * (1 + 1e-6)).all()
    assert np.array_equal(back[3], np.zeros(33, np.float32))
    with pytest.raises(LoracError, match="tensor t: has non-finite values"):
        int8.quantize(np.array([[1.0, np.inf]], np.float32), name="t")


# ------------------------------------------------------------------ weights dicts

def test_quantize_and_dequantize_weights():
    rng = np.random.default_rng(5)
    w = {"a.weight": rng.standard_normal((32, 64)).astype(np.float32), "norm.weight": np.ones(64, np.float32)}
    for kind, bound in (("nf4", 0.6), ("int8", 0.02), ("Q8_0", 0.02), ("Q4_0", 0.4)):
        q = quantize_weights(w, kind, ["a.weight"])
        assert "a.weight" not in q and q["norm.weight"] is w["norm.weight"]
        found = detect(q)
        assert list(found) == ["a.weight"] and found["a.weight"].kind == kind
        assert shape_of(q, "a.weight", found["a.weight"]) == (32, 64)
        names = {n for n, _, _ in quant_inputs(found["a.weight"], "a.weight", 32, 64)}
        assert names == set(q) - {"norm.weight"}  # the graph's inputs are exactly the dict's keys
        assert all(q[n].shape == s and q[n].dtype == np.dtype(d) for n, s, d in
                   quant_inputs(found["a.weight"], "a.weight", 32, 64))
        assert quantized_bytes(q) == sum(q[n].nbytes for n in names) < w["a.weight"].nbytes
        back = dequantize_weights(q)
        assert set(back) == set(w) and back["a.weight"].dtype == np.float32
        assert np.abs(back["a.weight"] - w["a.weight"]).max() < bound, kind
    with pytest.raises(LoracError, match="tensor a.weight: quantized, but a.weight.nf4_code is missing"):
        detect({"a.weight.nf4": np.zeros((2, 32), np.uint8)})


# ------------------------------------------------------------------ loaders

def write_hf_dir(path, w, layers=2, extra_config=None):
    from safetensors.numpy import save_file
    path.mkdir(parents=True, exist_ok=True)
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 32,
              "intermediate_size": 64, "num_hidden_layers": layers, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 64, "tie_word_embeddings": True,
              "rms_norm_eps": 1e-5, "max_position_embeddings": 128, **(extra_config or {})}
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: np.ascontiguousarray(v) for k, v in w.items()}, str(path / "model.safetensors"))
    return path


def targets(layers=2):
    return [f"model.layers.{i}.{m}.weight" for i in range(layers) for m in LINEAR]


def test_quantize_on_load_int8_and_nf4(tmp_path):
    from lorac.runtime.model.weights import load_model
    w = hf_weights("llama", np.random.default_rng(6))
    d = write_hf_dir(tmp_path / "m", w)
    _, dense = load_model(d)
    assert not detect(dense)  # the default is unchanged
    for kind in ("int8", "nf4"):
        _, q = load_model(d, quantize=kind)
        found = detect(q)
        assert sorted(found) == sorted(targets()) and {x.kind for x in found.values()} == {kind}
        assert all(n in q for n in ("model.embed_tokens.weight", "model.norm.weight", "model.layers.0.input_layernorm.weight"))
        back = dequantize_weights(q)
        for n in targets():
            err = np.abs(back[n] - w[n]).max(axis=1)
            rowmax = np.abs(w[n]).max(axis=1)
            assert (err <= rowmax * (0.5 / 127 if kind == "int8" else 0.2) * 1.0001).all(), (kind, n)
    with pytest.raises(LoracError, match=r"quantize='fp4' is not supported \(supported: nf4, int8\)"):
        load_model(d, quantize="fp4")


def bnb_dir(tmp_path, double=True, **config):
    """A tiny `*-bnb-4bit` directory: the seven projections as bitsandbytes saves them (from
    lorac's own quantizer; tests/test_quant_bnb.py makes one with bitsandbytes itself)."""
    w = hf_weights("llama", np.random.default_rng(7))
    tensors, arrays = {}, {}
    for n, x in w.items():
        if n in targets():
            arrays[n] = nf4.quantize(x, double=double)
            tensors.update(to_bnb(arrays[n], n, x.shape))
        else:
            tensors[n] = x.astype(np.float16)
    qc = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
          "bnb_4bit_use_double_quant": double, **config}
    return write_hf_dir(tmp_path / "bnb", tensors, extra_config={"quantization_config": qc}), w, arrays


@pytest.mark.parametrize("double", [False, True])
def test_bnb_dir_loads_as_nf4_arrays_or_dequantized(tmp_path, double):
    from lorac.runtime.model.weights import load_model
    d, w, arrays = bnb_dir(tmp_path, double)
    _, kept = load_model(d, keep_quantized=True)
    found = detect(kept)
    assert sorted(found) == sorted(targets()) and set(found.values()) == {Quant("nf4", 64, double)}
    for n in targets():
        assert all(np.array_equal(kept[f"{n}.{k}"], v) for k, v in arrays[n].items())
    assert kept["model.norm.weight"].dtype == np.float32
    _, dense = load_model(d)
    assert not detect(dense)
    for n in targets():
        assert np.array_equal(dense[n], nf4.dequantize(arrays[n], *w[n].shape))
        assert np.array_equal(dequantize_weights(kept)[n], dense[n])


@pytest.mark.parametrize("config,match", [
    ({"load_in_4bit": False, "load_in_8bit": True}, r"quantization_config.load_in_8bit: 8-bit bitsandbytes"),
    ({"bnb_4bit_quant_type": "fp4"}, r"quantization_config.bnb_4bit_quant_type='fp4' is not supported \(only nf4\)"),
    ({"quant_method": "gptq"}, r"quantization_config.quant_method='gptq' is not supported"),
    ({"bnb_4bit_quant_storage": "bfloat16"}, r"bnb_4bit_quant_storage='bfloat16' is not supported"),
])
def test_bnb_dir_refusals_name_the_field(tmp_path, config, match):
    from lorac.runtime.model.weights import load_model
    d, _, _ = bnb_dir(tmp_path, **config)
    with pytest.raises(LoracError, match=match) as e:
        load_model(d, keep_quantized=True)
    assert "\n" not in str(e.value) and str(d) in str(e.value)


def test_bnb_dir_corrupt_absmax_is_one_line(tmp_path):
    from safetensors.numpy import load_file, save_file
    from lorac.runtime.model.weights import load_model
    d, _, _ = bnb_dir(tmp_path, double=False)
    t = load_file(str(d / "model.safetensors"))
    t["model.layers.1.mlp.up_proj.weight.absmax"][3] = np.nan
    save_file(t, str(d / "model.safetensors"))
    with pytest.raises(LoracError, match=r"^tensor model.layers.1.mlp.up_proj.weight: corrupt absmax \(block 3"):
        load_model(d)


def test_gguf_keeps_its_quantized_projections(tmp_path):
    """Q4_K / Q6_K / Q8_0 projections (q/k rows permuted by llama.cpp) stay blocks; dequantized,
    they equal the dense load bit for bit; norms and embeddings stay dense; quantize= then
    quantizes only the projections that were dense."""
    from lorac.runtime.model.gguf import load_gguf
    kinds = {"q_proj": "Q4_K", "k_proj": "Q6_K", "v_proj": "Q8_0", "o_proj": "Q4_K",
             "gate_proj": "Q6_K", "up_proj": "F16", "down_proj": "Q4_K"}
    w = hf_weights("llama", np.random.default_rng(8), hidden=256, heads=4, kv=2, head_dim=64, ffn=512)
    path = tmp_path / "m.gguf"
    write_gguf(path, "llama", w, heads=4, kv=2, head_dim=64,
               qtype=lambda n: next((k for t, k in kinds.items() if t in n), "F32"))
    config, dense = load_gguf(path)
    _, kept = load_gguf(path, keep_quantized=True)
    found = detect(kept)
    assert {n: q.kind for n, q in found.items()} == {n: kinds[n.split(".")[-2]] for n in targets() if "up_proj" not in n}
    assert all(n in kept and kept[n].dtype == np.float32 for n in ("model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight"))
    back = dequantize_weights(kept)
    assert set(back) == set(dense)
    assert all(np.array_equal(back[n].view(np.uint32), dense[n].view(np.uint32)) for n in dense)
    _, mixed = load_gguf(path, keep_quantized=True, quantize="int8")
    assert {q.kind for n, q in detect(mixed).items() if "up_proj" in n} == {"int8"}
    assert len(detect(mixed)) == 14
    # quantize= alone: every target dense after loading is quantized
    _, requant = load_gguf(path, quantize="nf4")
    assert {q.kind for q in detect(requant).values()} == {"nf4"} and len(detect(requant)) == 14
    assert quantize_targets(config, dense, None) is dense


def test_sharded_bnb_dir_reads_state_in_float32_across_shards(tmp_path):
    """A bf16 load of a sharded bnb directory whose weight's absmax sits in another shard than
    its quant state: the state still reads as float32 (exact), the dense tensors as bf16."""
    from safetensors.numpy import load_file, save_file
    from lorac.runtime.model.weights import load_model
    d, _, arrays = bnb_dir(tmp_path, double=False)
    t = load_file(str(d / "model.safetensors"))
    (d / "model.safetensors").unlink()
    name = "model.layers.0.self_attn.q_proj.weight"
    second = {f"{name}.absmax": t.pop(f"{name}.absmax")}
    save_file(t, str(d / "model-00001-of-00002.safetensors"))
    save_file(second, str(d / "model-00002-of-00002.safetensors"))
    index = {n: "model-00001-of-00002.safetensors" for n in t} | {n: "model-00002-of-00002.safetensors" for n in second}
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    _, kept = load_model(d, dtype="bfloat16", keep_quantized=True)
    assert kept[f"{name}.absmax"].dtype == np.float32 and np.array_equal(kept[f"{name}.absmax"], arrays[name]["absmax"])
    assert kept["model.norm.weight"].dtype.name == "bfloat16"
