"""lorac's NF4 reference (runtime/model/quant/nf4.py) against bitsandbytes itself: its
quantize_4bit and dequantize_4bit on the CPU (bitsandbytes 0.50.2, the `test` extra) and, on
the GPU machine, on CUDA; and a `*-bnb-4bit` directory written from bnb's own quant state
(QuantState.as_dict(packed=True), what transformers saves) loads as the same NF4 arrays."""
from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
bnb_f = pytest.importorskip("bitsandbytes.functional")

from conftest import has_cuda_gpu  # noqa: E402
from lorac.graphs.ops.quant import Quant, detect  # noqa: E402
from lorac.runtime.model.quant import dequantize_weights
from lorac.runtime.model.quant import nf4  # noqa: E402
from test_quant_formats import hf_weights, targets, write_hf_dir  # noqa: E402

# odd shapes: out not a power of two; 4992 blocks of 64 (19.5 nested blocks of 256) and
# 1536 blocks (exactly 6 nested blocks: bnb's torch path divides in a short last block)
SHAPES = [(312, 1024), (96, 1024)]


def bnb_quantize(w: np.ndarray, double: bool, dtype=torch.float32, device="cpu"):
    t = torch.from_numpy(w).to(device=device, dtype=dtype)
    return bnb_f.quantize_4bit(t, blocksize=64, compress_statistics=double, quant_type="nf4")


def bnb_tensors(q, state, name: str) -> dict:
    """What transformers saves for a 4-bit weight: `name` and the packed quant state."""
    out = {name: q.cpu().numpy()}
    for k, v in state.as_dict(packed=True).items():
        out[f"{name}.{k}"] = v.cpu().numpy()
    return out


def weights_of(rng, shape, dtype=torch.float32) -> np.ndarray:
    """float32 values representable in dtype (so both sides quantize the same numbers)."""
    w = (rng.standard_normal(shape) * rng.uniform(0.01, 2, (shape[0], 1))).astype(np.float32)
    return torch.from_numpy(w).to(dtype).float().numpy()


def test_tables_are_bnbs():
    assert np.array_equal(nf4.NF4_CODE, bnb_f.get_4bit_type("nf4", device="cpu").numpy())
    assert np.array_equal(nf4.dynamic_map(), bnb_f.create_dynamic_map().numpy())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_quantize_matches_bnb(shape, dtype):
    """Codes and absmax bit for bit; double quantization: the nested codes and scales bit for
    bit given bnb's offset, against bnb's torch quantize_blockwise (its CPU library rounds
    through a 65536-entry table instead: at most one code apart); the offset within an ulp."""
    w = weights_of(np.random.default_rng(0), shape, dtype)
    q, state = bnb_quantize(w, False, dtype)
    ours = nf4.quantize(w, double=False)
    assert np.array_equal(ours["nf4"].reshape(-1), q.numpy().reshape(-1))
    assert np.array_equal(ours["absmax"], state.absmax.numpy())
    assert np.array_equal(ours["nf4_code"], state.code.numpy())

    q2, st2 = bnb_quantize(w, True, dtype)
    assert np.array_equal(q2.numpy(), q.numpy())
    offset = st2.offset.item()
    assert abs(nf4.quantize(w)["absmax_offset"][0] - offset) <= np.spacing(np.float32(offset))
    nested = nf4.double_quantize(ours["absmax"], offset)
    x = torch.from_numpy(ours["absmax"]) - st2.offset
    composite = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)
    ref_q, ref_scale = torch.ops.bitsandbytes.quantize_blockwise.default.redispatch(
        composite, x, torch.from_numpy(nf4.dynamic_map()), 256)
    assert np.array_equal(nested["absmax_scale"], ref_scale.numpy())
    if ours["absmax"].size % 256 == 0:  # the short-block case divides in bnb's torch path
        assert np.array_equal(nested["absmax_q"], ref_q.numpy())
    assert np.array_equal(nested["absmax_scale"], st2.state2.absmax.numpy())
    assert np.abs(nested["absmax_q"].astype(int) - st2.absmax.numpy().astype(int)).max() <= 1


@pytest.mark.parametrize("double", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_dequantize_matches_bnb_from_its_saved_state(double, dtype):
    """bnb's dequantize_4bit == nf4.dequantize of what from_bnb reads from bnb's saved tensors,
    bit for bit (a bf16 model: bnb's output is the float32 product rounded to bf16)."""
    import ml_dtypes
    shape = SHAPES[0]
    w = weights_of(np.random.default_rng(1), shape, dtype)
    q, state = bnb_quantize(w, double, dtype)
    ref = bnb_f.dequantize_4bit(q, state)
    arrays, got_shape = nf4.from_bnb(bnb_tensors(q, state, "w"), "w")
    assert got_shape == shape
    ours = nf4.dequantize(arrays, *shape)
    if dtype == torch.float32:
        assert ref.dtype == torch.float32 and np.array_equal(ours.view(np.uint32), ref.numpy().view(np.uint32))
    else:
        assert ref.dtype == torch.bfloat16
        assert np.array_equal(ours.astype(ml_dtypes.bfloat16).view(np.uint16), ref.view(torch.int16).numpy().view(np.uint16))


def test_rows_shorter_than_a_block_match_bnbs_torch_path():
    """bitsandbytes 0.50.2's CPU library mis-dequantizes weights whose rows are shorter than a
    block (32x32, block 64: every block past the first comes out wrong; found here); its torch
    implementation of the same op equals lorac's."""
    w = weights_of(np.random.default_rng(4), (32, 32))
    q, state = bnb_quantize(w, False)
    arrays, _ = nf4.from_bnb(bnb_tensors(q, state, "w"), "w")
    composite = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)
    ref = torch.ops.bitsandbytes.dequantize_4bit.default.redispatch(
        composite, q, state.absmax, 64, "nf4", (32, 32), torch.float32).numpy()
    assert np.array_equal(nf4.dequantize(arrays, 32, 32).view(np.uint32), ref.view(np.uint32))


def test_bnb_made_directory_loads_as_its_nf4(tmp_path):
    """A tiny `*-bnb-4bit` directory whose projections bnb quantized (double quantization, a
    bf16 model): kept, they are bnb's own tensors; dequantized, bnb's dequantize_4bit."""
    from lorac.runtime.model.weights import load_model
    w = hf_weights("llama", np.random.default_rng(2), hidden=64, head_dim=16, ffn=128)
    tensors, refs = {}, {}
    for n, x in w.items():
        if n in targets():
            q, state = bnb_quantize(x, True, torch.bfloat16)
            tensors.update(bnb_tensors(q, state, n))
            refs[n] = bnb_f.dequantize_4bit(q, state).float().numpy()
        else:
            tensors[n] = x
    qc = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
          "bnb_4bit_use_double_quant": True, "bnb_4bit_compute_dtype": "bfloat16"}
    d = write_hf_dir(tmp_path / "bnb", tensors, extra_config={"quantization_config": qc, "hidden_size": 64,
                                                               "head_dim": 16, "intermediate_size": 128})
    _, kept = load_model(d, keep_quantized=True)
    assert set(detect(kept).values()) == {Quant("nf4", 64, True)}
    name = targets()[0]
    assert np.array_equal(kept[f"{name}.nf4"].reshape(-1), tensors[name].reshape(-1))
    assert np.array_equal(kept[f"{name}.absmax_offset"][0], np.float32(json.loads(
        tensors[f"{name}.quant_state.bitsandbytes__nf4"].tobytes())["nested_offset"]))
    dense = dequantize_weights(kept)
    for n in targets():  # bnb rounds its float32 product to bf16; lorac keeps float32
        assert np.array_equal(torch.from_numpy(dense[n]).bfloat16().float().numpy(), refs[n]), n


@pytest.mark.gpu
@pytest.mark.skipif(not has_cuda_gpu(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("double", [False, True])
def test_cuda_bnb_matches_the_reference(double):
    """On CUDA (what `*-bnb-4bit` checkpoints were made with): bnb's quantize_4bit codes and
    absmax equal lorac's bit for bit, its nested codes too given its offset, and its
    dequantize_4bit (float32) equals lorac's dequantization of its state bit for bit."""
    for shape in SHAPES:
        w = weights_of(np.random.default_rng(3), shape)
        q, state = bnb_quantize(w, double, device="cuda")
        ours = nf4.quantize(w, double=False)
        assert np.array_equal(ours["nf4"].reshape(-1), q.cpu().numpy().reshape(-1))
        if double:
            nested = nf4.double_quantize(ours["absmax"], state.offset.item())
            assert np.array_equal(nested["absmax_q"], state.absmax.cpu().numpy())
            assert np.array_equal(nested["absmax_scale"], state.state2.absmax.cpu().numpy())
        else:
            assert np.array_equal(ours["absmax"], state.absmax.cpu().numpy())
        ref = bnb_f.dequantize_4bit(q, state).cpu().numpy()
        arrays, _ = nf4.from_bnb(bnb_tensors(q, state, "w"), "w")
        assert np.array_equal(nf4.dequantize(arrays, *shape).view(np.uint32), ref.view(np.uint32))
