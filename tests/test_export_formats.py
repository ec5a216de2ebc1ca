"""Exports that drop into other clients: the merged export of a GGUF base (SmolLM2) loads in
AutoTokenizer (same ids, same chat rendering), AutoModelForCausalLM (the merged weights, in
bf16) and GenerationConfig; a merged GGUF keeps the base's metadata and untouched tensors
byte for byte, and transformers reads it to lorac's merged weights; `lorac export --format
onnx` writes graphs that onnxruntime runs to transformers' loss and logits."""
import json
import subprocess
import sys

import numpy as np
import pytest

from lorac.runtime.export import lora_scale

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def random_lora(config, layers, targets, r=2, seed=0):
    from lorac.graphs import ModelSpec, lora_name
    spec = ModelSpec.from_hf_config(config)
    rng = np.random.default_rng(seed)
    out = {}
    for i in layers:
        for t in targets:
            o, n = spec.proj_shape(t)
            out[lora_name(i, t, "A")] = (rng.standard_normal((r, n)) / np.sqrt(n)).astype(np.float32)
            out[lora_name(i, t, "B")] = (0.05 * rng.standard_normal((o, r))).astype(np.float32)
    return out


def merged_reference(weights, lora, alpha, r=2):
    from lorac.graphs import weight_name
    out = dict(weights)
    for name, a in lora.items():
        if ".lora_A." in name:
            layer, target = int(name.split(".layers.")[1].split(".")[0]), name.split(".lora_A.")[0].rsplit(".", 1)[1]
            b = lora[name.replace(".lora_A.", ".lora_B.")]
            key = weight_name(layer, target)
            out[key] = weights[key] + lora_scale(alpha, r) * (b @ a)
    return out


@pytest.fixture(scope="module")
def smollm():
    from lorac.runtime.model.default import default_gguf_path
    from lorac.runtime.errors import LoracError
    try:
        path = default_gguf_path()
    except LoracError as e:
        pytest.skip(str(e))
    from lorac.runtime.model.source import resolve_model
    return path, resolve_model(None).load()


@pytest.mark.slow
def test_merged_export_of_a_gguf_base_loads_in_transformers(smollm, tmp_path):
    from lorac.runtime.export import export_merged_weights
    from lorac.runtime.model.gguf import float_dtype
    path, (config, weights, tok) = smollm
    lora = random_lora(config, (0, 29), ("q_proj", "down_proj"))
    out = export_merged_weights(tmp_path / "merged", weights, config, lora, alpha=4.0, tokenizer=tok,
                                dtype=float_dtype(path))
    ref_tok = transformers.AutoTokenizer.from_pretrained(out)
    for text in ["What is a kludge?", "naïve café 2024 ünïcödé", "  two  spaces\n\nand a tab\t!"]:
        assert ref_tok(text)["input_ids"] == tok.encode(text).tolist(), text
    chat = [{"role": "user", "content": "What is cruft?"}]
    assert ref_tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        tok.render_chat(chat, add_generation_prompt=True)
    assert ref_tok.eos_token_id == tok.eos_id
    assert transformers.GenerationConfig.from_pretrained(out).eos_token_id == tok.eos_id
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16  # the quantized base's default, half of fp32's size
    want = merged_reference(weights, lora, 4.0)
    state = model.state_dict()
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.29.mlp.down_proj.weight",
                 "model.layers.3.self_attn.v_proj.weight", "model.embed_tokens.weight"):
        np.testing.assert_array_equal(state[name].float().numpy(),
                                      torch.from_numpy(want[name]).to(torch.bfloat16).float().numpy(), err_msg=name)


def test_gguf_merged_on_a_quantized_llama_file(tmp_path):
    from lorac.runtime.export.gguf_merged import export_gguf_merged
    from lorac.runtime.model.gguf import load_gguf
    from test_gguf import hf_weights, write_gguf
    w = hf_weights("llama", np.random.default_rng(5), hidden=64, heads=4, kv=2, head_dim=16, ffn=64)
    base = tmp_path / "base.gguf"
    write_gguf(base, "llama", w, heads=4, kv=2, head_dim=16, qtype="Q8_0")
    config, before = load_gguf(base)
    lora = random_lora(config, (0, 1), ("q_proj", "k_proj", "v_proj", "down_proj"))
    out = export_gguf_merged(tmp_path / "merged.gguf", base, lora, alpha=4.0)
    _, after = load_gguf(out)
    want = merged_reference(before, lora, 4.0)
    for name, x in after.items():
        if "q_proj" in name or "k_proj" in name or "v_proj" in name or "down_proj" in name:
            np.testing.assert_allclose(x, want[name], rtol=1e-3, atol=1e-3, err_msg=name)  # one F16 rounding
            assert np.abs(x - before[name]).max() > 1e-3, name  # the LoRA is in there
        else:
            np.testing.assert_array_equal(x, before[name], err_msg=name)  # copied byte for byte
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="merged.gguf",
                                                            dtype=torch.float32).state_dict()
    for name, x in after.items():
        np.testing.assert_array_equal(x, ref[name].numpy(), err_msg=name)


def test_gguf_merged_in_the_base_types_of_a_k_quant_file(tmp_path):
    """--dtype base: each adapted matrix in its base tensor's own type (Q4_K, Q6_K, Q5_0 stay so,
    their blocks llama.cpp's quantization of W + s B A), Q2_K, which lorac cannot quantize to,
    written F16 and said so; untouched tensors byte for byte."""
    from lorac.runtime.export.gguf_merged import export_gguf_merged
    from lorac.runtime.model.gguf import load_gguf
    from lorac.runtime.model.quant.gguf_blocks import quantize
    from test_gguf import gguf_name, hf_weights, write_gguf
    w = hf_weights("llama", np.random.default_rng(6), hidden=256, heads=4, kv=2, head_dim=64, ffn=512, vocab=64)
    w = {k: v / np.float32(16) if v.ndim == 2 else v for k, v in w.items()}
    kinds = {"q_proj": "Q4_K", "k_proj": "Q4_K", "v_proj": "Q6_K", "o_proj": "Q4_K", "gate_proj": "Q2_K",
             "up_proj": "Q5_0", "down_proj": "Q6_K"}
    base = tmp_path / "base.gguf"
    write_gguf(base, "llama", w, heads=4, kv=2, head_dim=64, qtype=lambda n: next(
        (k for t, k in kinds.items() if t in n), "F32"))
    config, before = load_gguf(base)
    lora = random_lora(config, (0, 1), ("q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"))
    said = []
    out = export_gguf_merged(tmp_path / "m.gguf", base, lora, alpha=4.0, qtype="BASE", warn=said.append)
    a = {t.name: t for t in gguf.GGUFReader(str(base)).tensors}
    b = {t.name: t for t in gguf.GGUFReader(str(out)).tensors}
    adapted = {gguf_name(f"model.layers.{i}.{m}.weight") for i in (0, 1) for m in
               ("self_attn.q_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    for name, t in a.items():
        want = "F16" if name in adapted and t.tensor_type.name == "Q2_K" else t.tensor_type.name
        assert b[name].tensor_type.name == want, name
        if name not in adapted:
            assert np.array_equal(np.asarray(b[name].data), np.asarray(t.data)), name
    assert said == ["written F16, for lorac cannot quantize to their base types: blk.0.ffn_gate.weight (Q2_K), "
                    "blk.1.ffn_gate.weight (Q2_K)"]
    want = merged_reference(before, lora, 4.0)
    for hf in ("model.layers.1.self_attn.v_proj.weight", "model.layers.0.mlp.up_proj.weight",
               "model.layers.1.mlp.down_proj.weight"):  # rows in the file's order: no q/k permutation
        t = b[gguf_name(hf)]
        blocks = np.asarray(t.data).reshape(want[hf].shape[0], -1)
        assert np.array_equal(blocks, quantize(want[hf], t.tensor_type.name)), hf
    _, after = load_gguf(out)
    for hf in want:
        if any(f"layers.{i}.{m}" in hf for i in (0, 1) for m in ("q_proj", "v_proj", "up_proj", "down_proj")):
            assert np.abs(after[hf] - before[hf]).max() > 1e-3, hf  # the LoRA is in there
            step = np.abs(want[hf]).max() / 7  # within a 4-bit step of the row range, generously
            assert np.abs(after[hf] - want[hf]).max() < step, hf


def test_gguf_merged_keeps_the_metadata_of_smollm(smollm, tmp_path):
    from lorac.runtime.export.gguf_merged import export_gguf_merged
    path, (config, _, _) = smollm
    out = export_gguf_merged(tmp_path / "m.gguf", path, random_lora(config, (2,), ("v_proj",)), alpha=4.0,
                             qtype="Q8_0")
    a, b = gguf.GGUFReader(path), gguf.GGUFReader(str(out))
    assert set(a.fields) == set(b.fields)
    for key, field in a.fields.items():
        if not key.startswith("GGUF."):
            assert field.types == b.fields[key].types and field.contents() == b.fields[key].contents(), key
    types = {t.name: t.tensor_type.name for t in b.tensors}
    assert types == {t.name: t.tensor_type.name if t.name != "blk.2.attn_v.weight" else "Q8_0" for t in a.tensors}


def test_onnx_export_runs_in_onnxruntime(tmp_path):
    ort = pytest.importorskip("onnxruntime")
    import onnx
    from safetensors.numpy import load_file
    from tiny_model import make_model_dir
    model_dir = make_model_dir(tmp_path / "model", layers=2)
    ids = np.random.default_rng(0).integers(0, 60, (1, 8)).astype(np.int64)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir).float().eval()
    with torch.no_grad():
        out = hf(input_ids=torch.from_numpy(ids), labels=torch.from_numpy(ids))
    weights = load_file(str(model_dir / "model.safetensors"))
    for graph in ("train", "forward"):
        path = tmp_path / f"{graph}.onnx"
        r = subprocess.run([sys.executable, "-m", "lorac.runtime.cli", "export", "--format", "onnx", "--model",
                            str(model_dir), "--graph", graph, "--batch", "1", "--seq", "8", "--rank", "2",
                            "--targets", "q_proj,v_proj", "--out", str(path)], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-2000:]
        m = onnx.load(str(path))
        onnx.checker.check_model(m)
        sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        feeds = {}
        for i in sess.get_inputs():
            if i.name in ("input_ids", "labels"):
                feeds[i.name] = ids
            elif i.name in weights:
                feeds[i.name] = weights[i.name]
            else:  # LoRA: B = 0, so the graph computes the base model
                assert ".lora_" in i.name, i.name
                feeds[i.name] = np.zeros(i.shape, np.float32) if ".lora_B." in i.name else np.ones(i.shape, np.float32)
        res = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
        if graph == "train":
            assert abs(float(res["loss"]) - float(out.loss)) <= 1e-5 * float(out.loss)
            assert sum(k.endswith(".grad") for k in res) == 2 * 2 * 2  # 2 layers x q,v x A,B
        else:
            np.testing.assert_allclose(res["logits"], out.logits.numpy(), atol=1e-4)
