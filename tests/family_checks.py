"""The checks every model family passes (tests/test_family_*.py call them with its configs):
gradients against float64 finite differences and against HF autograd, HF-directory and GGUF
loading, and the PEFT / merged / GGUF-LoRA exports in their real clients (PEFT, transformers,
gguf's own name map)."""
from __future__ import annotations

import json
from dataclasses import replace

import numpy as np

from lorac.graphs import ModelSpec, TrainSpec, build_eval_graph, build_training_graph
from oracles import assert_grads_match, batch, directional_fd, hf_model, hf_weights, random_lora, rel_err, run_ort, torch_reference


def hf_parity(cfg: dict, B: int, S: int, targets=None, rslora=False, seed=0):
    """Loss and every LoRA gradient of lorac's graph against transformers' autograd."""
    spec = ModelSpec.from_hf_config(cfg)
    train = TrainSpec(batch=B, seq=S, lora_targets=tuple(targets or spec.targets), rank=3, alpha=6, rslora=rslora)
    model = hf_model(cfg, seed)
    lora = random_lora(spec, train)
    ids, labels = batch(spec, train)
    out = run_ort(build_training_graph(spec, train), {**hf_weights(model), **lora, "input_ids": ids, "labels": labels})
    assert_grads_match(out, *torch_reference(model, lora, ids, labels, train.scale), min_norm=1e-6)


def checkpointing_matches_plain(cfg: dict, B: int, S: int, seed=0):
    """With --checkpointing, the recomputed layers and the kept ones (which recompute the
    norms' outputs and the MLP activation: decoder.projection_inputs) give the plain graph's
    loss and gradients."""
    spec = ModelSpec.from_hf_config(cfg)
    kw = dict(batch=B, seq=S, lora_targets=tuple(spec.targets), rank=3, alpha=6)
    plain = TrainSpec(**kw)
    ids, labels = batch(spec, plain)
    feeds = {**hf_weights(hf_model(cfg, seed)), **random_lora(spec, plain), "input_ids": ids, "labels": labels}
    ref = run_ort(build_training_graph(spec, plain), feeds)
    out = run_ort(build_training_graph(spec, TrainSpec(**kw, checkpointing=True, keep_layers=1)), feeds)
    assert abs(out["loss"] - ref["loss"]) <= 1e-6 * abs(ref["loss"])
    for k, v in ref.items():
        if k.endswith(".grad"):
            assert rel_err(out[k], v) <= 1e-5, k


def finite_differences(cfg: dict, B: int, S: int, seed=0):
    """Every LoRA gradient of the float64 training graph against central differences of the
    float64 eval graph's loss (an independent formulation: LogSoftmax, no hand backward)."""
    spec = ModelSpec.from_hf_config(cfg)
    train = TrainSpec(batch=B, seq=S, lora_targets=spec.targets, rank=2, alpha=4)
    model = hf_model(cfg, seed)
    ids, labels = batch(spec, train)
    f = {k: v.astype(np.float64) for k, v in {**hf_weights(model), **random_lora(spec, train, b_scale=0.3)}.items()}
    f.update(input_ids=ids, labels=labels)
    out = run_ort(build_training_graph(spec, train, dtype="float64"), f)
    loss_model = build_eval_graph(spec, train, dtype="float64")
    assert abs(run_ort(loss_model, f)["loss"] - out["loss"]) <= 1e-12 * abs(out["loss"])
    rng, eps = np.random.default_rng(7), 1e-6
    grads = sorted(k for k in out if k.endswith(".grad"))
    assert len(grads) == 2 * len(spec.targets) * spec.layers
    for gname in grads:
        fd, an = directional_fd(loss_model, f, out, gname, rng, eps)
        assert abs(an) > 1e-8 and abs(fd - an) <= 1e-6 * max(1.0, abs(fd)), (gname, fd, an)


def save_hf(cfg: dict, path, seed=0):
    """A random HF model of `cfg` saved as a model directory; -> (model, config.json dict)."""
    model = hf_model(cfg, seed)
    model.save_pretrained(path)
    return model, json.loads((path / "config.json").read_text())


def hf_dir_loading(tmp_path, cfg: dict, B=2, S=5):
    """load_model on a saved directory gives transformers' own tensors and, through the
    graph, transformers' loss."""
    import torch

    from lorac.runtime.model.weights import load_model
    model, _ = save_hf(cfg, tmp_path / "m")
    config, weights = load_model(tmp_path / "m")
    ref = hf_weights(model)
    assert set(ref) <= set(weights)
    for k, v in ref.items():
        np.testing.assert_array_equal(weights[k], v, err_msg=k)
    spec = ModelSpec.from_hf_config(config)
    train = TrainSpec(batch=B, seq=S, lora_targets=spec.targets[:1], rank=2)
    ids, labels = batch(spec, train)
    lora = random_lora(spec, train)
    out = run_ort(build_training_graph(spec, train), {**weights, **lora, "input_ids": ids, "labels": labels})
    loss, _ = torch_reference(model, lora, ids, labels, train.scale)
    assert rel_err(out["loss"], loss) <= 1e-5
    return config, weights


def write_gguf(path, arch: str, weights: dict, meta: dict, transform=None):
    """A GGUF file with llama.cpp's tensor names for `arch`, taken from gguf's own name map
    (independent of lorac's tables); `meta` {key suffix: value} under `arch.`; `transform(hf
    name, array)` does what llama.cpp's converter does to a tensor."""
    import gguf
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], 64)
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in meta.items():
        (w.add_float32 if isinstance(value, float) else w.add_uint32)(f"{arch}.{key}", value)
    for name, t in weights.items():
        t = transform(name, t) if transform else t
        w.add_tensor(names.get_name(name, try_suffixes=(".weight",)), np.ascontiguousarray(t, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def gguf_loading(tmp_path, arch: str, weights: dict, config: dict, meta: dict, transform=None) -> dict:
    """load_gguf of a synthetic file of these weights gives them back under HF names and a
    config whose spec is the HF config's; -> the loaded config."""
    from lorac.runtime.model.gguf import load_gguf
    write_gguf(tmp_path / "m.gguf", arch, weights, meta, transform)
    got_config, got = load_gguf(tmp_path / "m.gguf")
    assert set(got) == set(weights)
    for k, v in weights.items():
        np.testing.assert_allclose(got[k], v, rtol=0, atol=1e-6, err_msg=k)
    # token ids come from the file's tokenizer keys (not written here); GGUF stores the eps as float32
    same = lambda spec: replace(spec, bos_id=None, eos_id=None, rms_eps=float(np.float32(spec.rms_eps)))
    assert same(ModelSpec.from_hf_config(got_config)) == same(ModelSpec.from_hf_config(config))
    return got_config


def peft_lora(spec, layers, targets, r=2, seed=5) -> dict:
    """PEFT-named LoRA tensors with B != 0 (a wrong key, scale or row order shows in the logits)."""
    from lorac.graphs.families import for_spec
    fam, rng, out = for_spec(spec), np.random.default_rng(seed), {}
    for i in layers:
        for t in targets:
            o, n = spec.proj_shape(t)
            out[fam.lora_name(i, t, "A")] = (rng.uniform(-1, 1, (r, n)) / np.sqrt(n)).astype(np.float32)
            out[fam.lora_name(i, t, "B")] = (rng.standard_normal((o, r)) * 0.2).astype(np.float32)
    return out


def exports(tmp_path, cfg: dict, gguf_arch: str, layers=(0, 1), targets=None, alpha=4.0):
    """The PEFT adapter in PEFT, the merged model in transformers (both against the base with
    W + s B A merged here in numpy), and the GGUF adapter's names against gguf's map."""
    import gguf
    import torch
    import transformers
    from peft import PeftModel
    from safetensors.numpy import load_file

    from lorac.runtime.export import export_gguf, export_merged, export_peft, lora_scale
    base = tmp_path / "base"
    _, config = save_hf(cfg, base)
    spec = ModelSpec.from_hf_config(config)
    targets = list(targets or spec.targets)
    lora = peft_lora(spec, layers, targets)
    s = lora_scale(alpha, 2)
    ids = np.random.default_rng(1).integers(0, spec.vocab, (2, 7))
    w = load_file(str(base / "model.safetensors"))
    for name, a in lora.items():
        if ".lora_A." in name:
            key = name.replace("base_model.model.", "").replace(".lora_A.weight", ".weight")
            w[key] = (w[key].astype(np.float64) + s * lora[name.replace(".lora_A.", ".lora_B.")] @ a).astype(np.float32)
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(base, attn_implementation="eager").eval()
    ref_model.load_state_dict({k: torch.from_numpy(v) for k, v in w.items()}, strict=False)
    with torch.no_grad():
        ref = ref_model(torch.tensor(ids)).logits.numpy()

    adapter = export_peft(tmp_path / "adapter", lora, alpha=alpha, base_model_name_or_path=str(base),
                          num_hidden_layers=spec.layers)
    plain = transformers.AutoModelForCausalLM.from_pretrained(base, attn_implementation="eager").eval()
    with torch.no_grad():
        assert np.max(np.abs(plain(torch.tensor(ids)).logits.numpy() - ref)) > 1e-3  # the adapter matters
    peft_model = PeftModel.from_pretrained(plain, adapter).eval()
    sd = {k.replace(".default", ""): v.numpy() for k, v in peft_model.state_dict().items() if "lora_" in k}
    assert set(sd) == set(lora) and all(np.array_equal(sd[k], lora[k]) for k in lora)
    with torch.no_grad():
        assert np.max(np.abs(peft_model(torch.tensor(ids)).logits.numpy() - ref)) <= 1e-4

    merged = export_merged(tmp_path / "merged", base, lora, alpha=alpha)
    m = transformers.AutoModelForCausalLM.from_pretrained(merged, attn_implementation="eager").eval()
    with torch.no_grad():
        assert np.max(np.abs(m(torch.tensor(ids)).logits.numpy() - ref)) <= 1e-4

    path = export_gguf(tmp_path / "a.gguf", lora, alpha=alpha, model_config=config)
    rd = gguf.GGUFReader(str(path))
    assert rd.fields["general.architecture"].contents() == gguf_arch
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[gguf_arch.upper()], spec.layers)
    tensors = {t.name: t for t in rd.tensors}
    assert len(tensors) == len(lora)
    for name, a in lora.items():
        if ".lora_A." not in name:
            continue
        b = lora[name.replace(".lora_A.", ".lora_B.")]
        stem = names.get_name(name.replace("base_model.model.", "").replace(".lora_A.weight", ""))
        np.testing.assert_array_equal(np.asarray(tensors[f"{stem}.weight.lora_a"].data).reshape(a.shape), a)
        np.testing.assert_array_equal(np.asarray(tensors[f"{stem}.weight.lora_b"].data).reshape(b.shape), b)
    return config
