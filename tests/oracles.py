"""Shared test oracles: HF transformers models in torch, onnxruntime as the reference executor."""
from __future__ import annotations

import numpy as np

from lorac.graphs import ModelSpec, TrainSpec, lora_tensor_names

def hf_model(cfg: dict, seed: int = 0):
    """A randomly initialised HF causal LM in fp32 (the transformers class of cfg's model_type,
    eager attention) with norm weights and biases made non-trivial."""
    import torch
    import transformers
    torch.manual_seed(seed)
    kw = {k: v for k, v in cfg.items() if k != "model_type"}
    conf = transformers.AutoConfig.for_model(cfg["model_type"], **kw)
    conf._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(conf).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def hf_weights(model) -> dict[str, np.ndarray]:
    """Frozen weights under HF names (lm_head dropped when tied)."""
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    return sd


def random_lora(spec: ModelSpec, train: TrainSpec, seed: int = 1, b_scale: float = 0.05) -> dict[str, np.ndarray]:
    """LoRA tensors with B != 0, so every term of the gradient is exercised."""
    rng = np.random.default_rng(seed)
    out = {}
    for name in lora_tensor_names(spec, train):
        t = name.split(".lora_")[0].rsplit(".", 1)[1]
        o, i = spec.proj_shape(t)
        shape = (train.rank, i) if ".lora_A." in name else (o, train.rank)
        scale = 1 / np.sqrt(i) if ".lora_A." in name else b_scale
        out[name] = (scale * rng.standard_normal(shape)).astype(np.float32)
    return out


def batch(spec: ModelSpec, train: TrainSpec, seed: int = 2, ignore_frac: float = 0.2):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, spec.vocab, (train.batch, train.seq)).astype(np.int64)
    labels = ids.copy()
    labels[rng.random(labels.shape) < ignore_frac] = -100
    return ids, labels


def torch_reference(model, lora: dict, ids, labels, scale: float):
    """HF loss and dL/dA, dL/dB from autograd's dense dW_eff: dA = s B^T dW, dB = s dW A^T."""
    import torch
    params = dict(model.named_parameters())
    adapted = {}
    with torch.no_grad():
        for name, a in lora.items():
            if ".lora_A." not in name:
                continue
            w_name = name.replace("base_model.model.", "").replace(".lora_A.weight", ".weight")
            A = torch.from_numpy(a)
            B = torch.from_numpy(lora[name.replace(".lora_A.", ".lora_B.")])
            params[w_name].add_(scale * B @ A)
            adapted[name] = (w_name, A, B)
    model.zero_grad()
    out = model(input_ids=torch.from_numpy(ids), labels=torch.from_numpy(labels))
    out.loss.backward()
    grads = {}
    for name, (w_name, A, B) in adapted.items():
        dW = params[w_name].grad.double()
        grads[name + ".grad"] = (scale * B.double().T @ dW).numpy()
        grads[name.replace(".lora_A.", ".lora_B.") + ".grad"] = (scale * dW @ A.double().T).numpy()
    return float(out.loss), grads


def run_ort(model_proto, feeds: dict) -> dict[str, np.ndarray]:
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    if any(getattr(v, "dtype", None) == np.float64 for v in feeds.values()):
        # ORT's fusions (FusedMatMul) have float32 kernels only
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model_proto.SerializeToString(), so, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    wanted = {i.name for i in sess.get_inputs()}
    return dict(zip(names, sess.run(None, {k: v for k, v in feeds.items() if k in wanted})))


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def assert_grads_match(out: dict, loss: float, grads: dict, tol: float = 1e-4, min_norm: float = 0.0) -> None:
    """Loss and every `<lora>.grad` of a graph run against a reference (loss, {name.grad: array})."""
    assert rel_err(out["loss"], loss) <= tol
    assert set(grads) == {k for k in out if k.endswith(".grad")}
    for k, ref in grads.items():
        assert np.linalg.norm(ref) > min_norm, k
        assert rel_err(out[k], ref) <= tol, (k, rel_err(out[k], ref))


def assert_frozen_prefix_matches(model, feeds: dict, ref: dict, below: int = 1) -> None:
    """A frozen-prefix graph (layers < `below` untrained) has no backward or adapters there and
    the same loss and gradients as the full graph's `ref` outputs."""
    assert not any(n.name.startswith(f"L{i}.bwd") for n in model.graph.node for i in range(below))
    assert not any(f".layers.{i}." in x.name and "lora" in x.name for x in model.graph.input for i in range(below))
    out = run_ort(model, feeds)
    assert abs(out["loss"] - ref["loss"]) <= 1e-6 * abs(ref["loss"])
    grads = lambda d: {k: v for k, v in d.items() if k.endswith(".grad")}
    assert set(grads(out)) == {k for k in grads(ref) if not any(f".layers.{i}." in k for i in range(below))}
    for k, v in grads(out).items():
        assert rel_err(v, ref[k]) <= 1e-6, k


def directional_fd(loss_model, feeds: dict, out: dict, gname: str, rng, eps: float = 1e-6) -> tuple[float, float]:
    """(central finite difference of the loss along a random direction v of input
    gname[:-5], the analytic gradient out[gname] . v), in the feeds' dtype (float64)."""
    name = gname[: -len(".grad")]
    v = rng.standard_normal(feeds[name].shape)
    plus, minus = dict(feeds), dict(feeds)
    plus[name], minus[name] = feeds[name] + eps * v, feeds[name] - eps * v
    fd = (run_ort(loss_model, plus)["loss"] - run_ort(loss_model, minus)["loss"]) / (2 * eps)
    return fd, float(np.sum(out[gname] * v))
