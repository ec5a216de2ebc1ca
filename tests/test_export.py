"""Export: PEFT adapter and merged model against transformers/PEFT, GGUF read back with gguf."""
import json
import math

import numpy as np
import pytest

from lorac.runtime.errors import LoracError
from lorac.graphs.families import llama
from lorac.runtime.export import export_gguf, export_merged, export_merged_weights, export_peft, llama_qk_permute, lora_scale

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ALL = list(llama.TARGETS)
PARENT = {t: llama.lora_name(0, t, "A").split(".")[-4] for t in ALL}  # self_attn | mlp
GGUF_TENSOR = llama.GGUF_TARGETS


def tiny_model(kind, path):
    """A random tiny Llama (GQA, untied head) or Qwen3 (QK-norm, tied) saved as safetensors."""
    torch.manual_seed(0)
    common = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    if kind == "llama":
        cfg = transformers.LlamaConfig(**common, tie_word_embeddings=False)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.Qwen3Config(**common, head_dim=8, tie_word_embeddings=True)
        model = transformers.Qwen3ForCausalLM(cfg)
    model.save_pretrained(path)
    return json.loads((path / "config.json").read_text())


def random_lora(config, layers, targets, r, seed):
    """B != 0 everywhere, so a wrong key, scale or permutation shows in the logits."""
    rng = np.random.default_rng(seed)
    h, ff = config["hidden_size"], config["intermediate_size"]
    hd = config.get("head_dim") or h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    dims = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, ff), "up_proj": (h, ff), "down_proj": (ff, h)}
    out = {}
    for i in layers:
        for t in targets:
            din, dout = dims[t]
            pre = f"base_model.model.model.layers.{i}.{PARENT[t]}.{t}"
            out[f"{pre}.lora_A.weight"] = rng.uniform(-1, 1, (r, din)).astype(np.float32) / math.sqrt(din)
            out[f"{pre}.lora_B.weight"] = (rng.standard_normal((dout, r)) * 0.2).astype(np.float32)
    return out


def reference_logits(model_dir, lora, s, ids):
    """transformers on weights merged here with plain numpy (independent of lorac's merge)."""
    from safetensors.numpy import load_file
    w = load_file(str(model_dir / "model.safetensors"))
    for name, a in lora.items():
        if ".lora_A." in name:
            b = lora[name.replace(".lora_A.", ".lora_B.")]
            key = name.replace("base_model.model.", "").replace(".lora_A.weight", ".weight")
            w[key] = (w[key].astype(np.float64) + s * (b.astype(np.float64) @ a.astype(np.float64))).astype(np.float32)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    missing, unexpected = model.load_state_dict({k: torch.from_numpy(v) for k, v in w.items()}, strict=False)
    assert not unexpected and all("lm_head" in k for k in missing)  # tied head is not stored
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.numpy()


CASES = [  # kind, adapted layers, targets, rank, alpha, rsLoRA
    ("llama", [0, 1, 2], ALL, 4, 8.0, False),
    ("qwen3", [1], ["q_proj", "v_proj", "down_proj"], 2, 4.0, True),
]


@pytest.mark.parametrize("kind,layers,targets,r,alpha,rs", CASES)
def test_peft_and_merged_exports_match_reference(tmp_path, kind, layers, targets, r, alpha, rs):
    from peft import PeftModel
    base = tmp_path / "base"
    config = tiny_model(kind, base)
    (base / "tokenizer.json").write_text("{}")  # stands in for real tokenizer files: copied as is
    lora = random_lora(config, layers, targets, r, seed=7)
    ids = np.random.default_rng(1).integers(0, config["vocab_size"], (2, 11))
    ref = reference_logits(base, lora, lora_scale(alpha, r, rs), ids)

    adapter = export_peft(tmp_path / "adapter", lora, alpha=alpha, use_rslora=rs,
                          base_model_name_or_path=str(base), num_hidden_layers=config["num_hidden_layers"])
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    assert cfg["layers_to_transform"] == (None if len(layers) == config["num_hidden_layers"] else layers)
    peft_model = PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base), adapter).eval()
    with torch.no_grad():
        got = peft_model(torch.tensor(ids)).logits.numpy()
    assert np.max(np.abs(got - ref)) <= 1e-4
    # every tensor we wrote was loaded into the LoRA layers (none silently ignored)
    sd = {k.replace(".default", ""): v for k, v in peft_model.state_dict().items() if "lora_" in k}
    assert set(sd) == set(lora)
    assert all(np.array_equal(sd[k].numpy(), lora[k]) for k in lora)
    # and the base is really changed by the adapter
    plain = transformers.AutoModelForCausalLM.from_pretrained(base).eval()
    with torch.no_grad():
        assert np.max(np.abs(plain(torch.tensor(ids)).logits.numpy() - ref)) > 1e-3

    merged = export_merged(tmp_path / "merged", base, lora, alpha=alpha, use_rslora=rs)
    from safetensors.numpy import load_file
    in_memory = export_merged_weights(tmp_path / "merged2", load_file(str(base / "model.safetensors")), config, lora,
                                      alpha=alpha, use_rslora=rs, tokenizer_dir=base)
    for d in (merged, in_memory):
        assert (d / "tokenizer.json").exists()
        m = transformers.AutoModelForCausalLM.from_pretrained(d).eval()
        with torch.no_grad():
            assert np.max(np.abs(m(torch.tensor(ids)).logits.numpy() - ref)) <= 1e-4


def test_merged_keeps_bf16_source_dtype(tmp_path):
    base = tmp_path / "base"
    config = tiny_model("qwen3", base)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "bf16")
    lora = random_lora(config, [0], ["o_proj"], 2, seed=3)
    merged = export_merged(tmp_path / "merged", tmp_path / "bf16", lora, alpha=2.0)
    from safetensors import safe_open
    with safe_open(str(merged / "model.safetensors"), "np") as f:
        w = f.get_tensor("model.layers.0.self_attn.o_proj.weight")
    with safe_open(str(tmp_path / "bf16" / "model.safetensors"), "np") as f:
        w0 = f.get_tensor("model.layers.0.self_attn.o_proj.weight")
    assert str(w.dtype) == "bfloat16"
    a, b = lora["base_model.model.model.layers.0.self_attn.o_proj.lora_A.weight"], \
        lora["base_model.model.model.layers.0.self_attn.o_proj.lora_B.weight"]
    want = w0.astype(np.float32) + 1.0 * (b @ a)
    assert np.max(np.abs(w.astype(np.float32) - want)) <= 2 ** -7 * np.max(np.abs(want))  # one bf16 rounding


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_gguf_adapter_reads_back(tmp_path, kind):
    import gguf
    config = tiny_model(kind, tmp_path / "base")
    lora = random_lora(config, [0, 2], ALL, 4, seed=9)
    path = export_gguf(tmp_path / "a.gguf", lora, alpha=16.0, model_config=config, use_rslora=(kind == "qwen3"))
    rd = gguf.GGUFReader(str(path))
    fields = {k: f.contents() for k, f in rd.fields.items()}
    assert fields["general.architecture"] == kind
    assert fields["general.type"] == "adapter" and fields["adapter.type"] == "lora"
    want_alpha = 16.0 * math.sqrt(4) if kind == "qwen3" else 16.0  # llama.cpp scales alpha/r
    assert fields["adapter.lora.alpha"] == pytest.approx(want_alpha)
    tensors = {t.name: t for t in rd.tensors}
    assert len(tensors) == len(lora)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA if kind == "llama" else gguf.MODEL_ARCH.QWEN3, 3)
    n_head, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    for name, a in lora.items():
        if ".lora_A." not in name:
            continue
        b = lora[name.replace(".lora_A.", ".lora_B.")]
        hf = name.replace("base_model.model.", "").replace(".lora_A.weight", "")
        target = hf.split(".")[-1]
        base = names.get_name(hf + ".weight", try_suffixes=(".weight",))
        assert base == f"blk.{hf.split('.')[2]}.{GGUF_TENSOR[target]}.weight"
        ta, tb = tensors[base + ".lora_a"], tensors[base + ".lora_b"]
        assert list(ta.shape) == [a.shape[1], a.shape[0]] and list(tb.shape) == [b.shape[1], b.shape[0]]  # ne order
        assert ta.tensor_type == gguf.GGMLQuantizationType.F32
        assert np.array_equal(np.asarray(ta.data).reshape(a.shape), a)
        got_b = np.asarray(tb.data).reshape(b.shape)
        heads = {"q_proj": n_head, "k_proj": n_kv}.get(target)
        if kind == "llama" and heads:
            # row map written out by hand: head h, pair i, half j -> GGML row h*d + 2i + j
            d = b.shape[0] // heads
            want = np.empty_like(b)
            for h in range(heads):
                for i in range(d // 2):
                    for j in range(2):
                        want[h * d + 2 * i + j] = b[h * d + j * (d // 2) + i]
            assert np.array_equal(got_b, want)
            assert np.allclose(got_b @ a, llama_qk_permute(b @ a, heads), atol=1e-6)
        else:
            assert np.array_equal(got_b, b)


def test_bad_inputs_are_one_line_errors(tmp_path):
    with pytest.raises(LoracError, match="not a LoRA tensor name"):
        export_peft(tmp_path / "x", {"model.layers.0.self_attn.q_proj.weight": np.zeros((2, 2))}, alpha=1)
    lora = random_lora({"hidden_size": 8, "intermediate_size": 8, "num_attention_heads": 2, "num_key_value_heads": 2},
                       [0], ["q_proj"], 2, seed=0)
    with pytest.raises(LoracError, match="not its partner"):
        export_peft(tmp_path / "x", {k: v for k, v in lora.items() if "lora_A" in k}, alpha=1)
    with pytest.raises(LoracError, match="GGUF export supports"):
        export_gguf(tmp_path / "x.gguf", lora, alpha=1, model_config={"architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(LoracError, match="no config.json"):
        export_merged(tmp_path / "m", tmp_path, lora, alpha=1)


def test_permutation_is_inverted_by_the_gguf_loader():
    """lorac's GGUF reader undoes llama.cpp's q/k order; export must redo exactly that."""
    gguf_model = pytest.importorskip("lorac.runtime.model.gguf")
    b = np.random.default_rng(0).standard_normal((24, 3)).astype(np.float32)
    for heads in (1, 2, 3, 6):
        assert np.array_equal(gguf_model.unpermute_qk(llama_qk_permute(b, heads), heads), b)


DISK_FULL_EXPORT = """
import resource, signal, sys
import numpy as np
from lorac.runtime.errors import LoracError
from lorac.runtime.export import export_peft
pre = "base_model.model.model.layers.0.self_attn.q_proj"
lora = {pre + ".lora_A.weight": np.ones((64, 512), np.float32), pre + ".lora_B.weight": np.ones((512, 64), np.float32)}
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)             # writes past the limit fail with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, resource.RLIM_INFINITY))  # as on a full disk
try:
    export_peft(sys.argv[1], lora, alpha=16.0)
except LoracError as e:
    print("ERROR", e)
"""


def test_a_full_disk_during_export_is_one_line_and_leaves_nothing(tmp_path):
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", DISK_FULL_EXPORT, str(tmp_path / "adapter")], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stdout.startswith(f"ERROR cannot write {tmp_path / 'adapter'}: ") and r.stdout.count("\n") == 1, r.stdout
    assert list(tmp_path.iterdir()) == []
