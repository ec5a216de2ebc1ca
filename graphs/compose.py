"""How every model family becomes one graph: the public `build_*_graph` functions.

A family module (graphs/families/: llama.py and qwen3.py through graphs/decoder.py,
mamba.py through graphs/mamba.py, ...) provides `declare_weights`, `Ctx`,
`embed`, `layer_forward`, `layer_backward`, `lora_tensor_names` and `describe`; this file
composes them. Emission order is execution order: the forward over all layers (keeping
what each layer's backward needs, or only the layer input with checkpointing), the head
and loss with its gradient, then the layers' backward from the top down to the lowest
trained layer. Nothing below that layer gets a backward node (frozen prefix).
"""
from __future__ import annotations

import onnx

from .builder import INT64, GraphBuilder
from .ops.loss import logits_forward, loss_and_grad, loss_only
from .ops.norm import rmsnorm_backward, rmsnorm_forward
from .ops.offload import fetch, offload


def family(spec):
    """The family module that builds graphs of `spec` (graphs/families/)."""
    from .families import for_spec
    return for_spec(spec)


def build_training_graph(spec, train, dtype="float32") -> onnx.ModelProto:
    """Loss and the exact gradient of every LoRA tensor, in one graph.

    `dtype` is the float type of every weight and activation: float32 for training (the
    compiler lowers GEMMs to bf16 on GPUs), float64 for finite-difference checks.
    """
    fam = family(spec)
    g, c, layers, final_norm, head, x = _start(fam, spec, train, dtype, "train")
    labels = g.input("labels", [train.batch, train.seq], INT64)
    lowest = train.layers(spec)[0]
    state = offloads_state(spec, train)
    if train.keep_mlp and not hasattr(fam, "mlp_state"):
        raise ValueError(f"--keep-mlp is not implemented for {spec.arch}")
    if train.keep_mlp and not state:
        raise ValueError("--keep-mlp keeps the MLP half of layers whose attention state waits in host memory; at "
                         "this shape the state stays (--offload-state auto sends it only where the host link keeps "
                         "up: use --offload-state on)")
    inputs, saved, mlps = [], [], {}
    for L in layers:
        g.scope = f"L{L.idx}.fwd"
        recomputed = train.recomputes(spec, L.idx) and L.idx >= lowest
        # with offload, a recomputed layer's input (and with `state` its attention's) waits in host
        # memory (graphs/ops/offload.py)
        kept = offload(g, [x], L.idx) if recomputed and train.offload and not state else x
        x_out, s = fam.layer_forward(c, x, L)
        if recomputed and state:
            held, wide = fam.attention_state(s)
            kept = offload(g, [x] + held, L.idx, wide=tuple(1 + i for i in wide))  # after the input
            if train.keeps_mlp(spec, L.idx):  # its MLP's gate and up stay on the device (TrainSpec.keep_mlp)
                mlps[L.idx] = fam.mlp_state(s)
        inputs.append(kept)
        x = x_out
        saved.append(None if (recomputed or L.idx < lowest) else s)
    g.scope = "head"
    hN, nN = rmsnorm_forward(g, x, final_norm, spec.rms_eps)
    loss, dhN = loss_and_grad(g, hN, head, labels, train.batch, train.seq, spec.vocab, train.loss_chunk,
                              spec.logit_softcap, train.head_slices)
    dx = rmsnorm_backward(g, dhN, final_norm, nN)
    grads: dict = {}
    for L in reversed(layers[lowest:]):
        g.scope = f"L{L.idx}.bwd"
        s = saved[L.idx]
        if s is None and state:  # the input and attention state back: recompute the MLP half
            x_in, *held = fetch(g, inputs[L.idx], L.idx)
            s = fam.layer_refill(c, x_in, held, L, mlps.get(L.idx))
        elif s is None:  # checkpointing: recompute this layer's forward from its kept input
            x_in = fetch(g, inputs[L.idx], L.idx)[0] if train.offload else inputs[L.idx]
            c.recomputing = True  # a family may stop before what only the layer's output needs
            _, s = fam.layer_forward(c, x_in, L)
            c.recomputing = False
        c.fresh = saved[L.idx] is None
        dx = fam.layer_backward(c, dx, L, s, need_dx=L.idx > lowest, grads=grads)
        c.fresh = False
    g.scope = "out"
    g.output(g.reshape(loss), "loss")
    for name in fam.lora_tensor_names(spec, train):
        g.output(grads[name], name + ".grad")
    return g.finish(doc=fam.describe(spec, train, "training"), metadata=_metadata(fam), data_prop=_data_prop(train))


def offloads_state(spec, train) -> bool:
    """Whether the step's offloaded layers send their attention state too (TrainSpec.offload_state,
    where the family implements it; None: where the family says the copies hide behind the forward)."""
    fam = family(spec)
    if not train.offload or not hasattr(fam, "layer_refill"):
        return False
    return fam.state_offload_pays(spec) if train.offload_state is None else bool(train.offload_state)


def build_forward_graph(spec, train, dtype="float32") -> onnx.ModelProto:
    """Logits [B, S, V] of base + adapter (eval and generation); same inputs minus labels."""
    fam = family(spec)
    g, hN, head = _forward_only(fam, spec, train, dtype, "forward")
    logits = logits_forward(g, hN, head, spec.logit_softcap, train.head_slices)
    g.output(g.reshape(logits, train.batch, train.seq, spec.vocab), "logits")
    return g.finish(doc=fam.describe(spec, train, "forward"), metadata=_metadata(fam), data_prop=_data_prop(train))


def build_eval_graph(spec, train, dtype="float32") -> onnx.ModelProto:
    """The training graph's loss without any backward node (eval loss; autodiff oracles)."""
    fam = family(spec)
    g, hN, head = _forward_only(fam, spec, train, dtype, "eval")
    labels = g.input("labels", [train.batch, train.seq], INT64)
    g.output(g.reshape(loss_only(g, hN, head, labels, train.batch, train.seq, train.loss_chunk, spec.logit_softcap,
                                 train.head_slices)), "loss")
    return g.finish(doc=fam.describe(spec, train, "eval"), metadata=_metadata(fam), data_prop=_data_prop(train))


RESIDUAL_KEY = "lorac.residual_dtype"  # graph metadata: "float32" where the stream must stay fp32


def _data_prop(train) -> bool:
    """ONNX shape inference's data propagation, which lorac's graphs never need (every shape is a
    constant; the dense graphs come out the same without it), is off where weights are quantized:
    it holds the long 1-D values of a dequantization as shapes (a Llama-3-8B layer's NF4 absmax:
    ~6 GB and 14 s of shape inference a layer)."""
    return not train.quant


def _metadata(fam) -> dict:
    """What the compiler may not infer from the ops: a family whose reference keeps the
    residual stream in fp32 in bf16 models (compiler/passes/residual_stream.py)."""
    return {RESIDUAL_KEY: "float32"} if fam.RESIDUAL_IN_FP32 else {}


def lora_tensor_names(spec, train) -> list[str]:
    """Every LoRA tensor of the graph in output order: by layer, target, then A before B."""
    return family(spec).lora_tensor_names(spec, train)


def _start(fam, spec, train, dtype, kind):
    train.validate(spec)
    if str(dtype) not in ("float32", "float64"):
        raise ValueError(f"graph dtype must be float32 or float64, got {dtype!r}")
    g = GraphBuilder(f"lorac_{kind}_{spec.arch}", str(dtype))
    ids = g.input("input_ids", [train.batch, train.seq], INT64)
    # packed rows of isolated documents: each token's position in its document (docs/DATA.md)
    positions = g.input("position_ids", [train.batch, train.seq], INT64) if train.packing == "isolated" else None
    embed, layers, final_norm, head = fam.declare_weights(g, spec, train)
    c = fam.Ctx(g, spec, train, positions)
    g.scope = "fwd"
    return g, c, layers, final_norm, head, fam.embed(g, embed, ids, spec, train)


def _forward_only(fam, spec, train, dtype, kind):
    g, c, layers, final_norm, head, x = _start(fam, spec, train, dtype, kind)
    for L in layers:
        g.scope = f"L{L.idx}.fwd"
        x, _ = fam.layer_forward(c, x, L)
    g.scope = "head"
    hN, _ = rmsnorm_forward(g, x, final_norm, spec.rms_eps)
    return g, hN, head
