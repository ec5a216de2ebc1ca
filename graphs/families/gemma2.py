"""Gemma 2 (HF `Gemma2ForCausalLM`): a decoder with sandwich norms, GeGLU, soft-capping and
sliding-window attention on alternate layers.

Shape legend: B batch, S seq, N = B*S tokens, D hidden, H heads, K kv heads, G = H/K,
Dh head dim (from the config, not D/H), I intermediate, V vocab.

    x0 = embed(ids) * sqrt(D)                                    (fp32 constant, as HF)
    one layer, every norm RMSNorm with scale (1 + w):
      x1 = x + post_attn_norm(o_proj(attn(rope(q), rope(k), v)))  q, k, v from in_norm(x)
      x_out = x1 + post_ffw_norm(down(gelu_tanh(gate(h2)) * up(h2))),  h2 = pre_ffw_norm(x1)
    attention: scores (q k^T) / sqrt(query_pre_attn_scalar), soft-capped c tanh(s / c) with
      c = attn_logit_softcapping, then the causal mask, on "sliding_attention" layers (HF's
      default: the even ones) with the window too (graphs/ops/attention.py Mask)
    logits = c' tanh(h E^T / c'), c' = final_logit_softcapping (graphs/ops/loss.py)
The (1 + w) scale is w + 1 formed in the graph from HF's stored w, so norm.py serves as is
(its backward never differentiates the frozen weight). The backward of a sandwich norm is
norm.py's backward on the block's output before the residual add.

Names: HF model.layers.N.{input_layernorm, post_attention_layernorm, pre_feedforward_layernorm,
post_feedforward_layernorm, self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj}. llama.cpp
(architecture gemma2) stores every norm weight as 1 + w (its converter adds the one), which
the loader takes off again; the rows of q/k are not permuted.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import onnx_ir as ir

from ..ops.attention import AttentionSaved, Mask, attention_backward, attention_forward
from ..decoder import Ctx, describe, lora_backward, projection_inputs  # noqa: F401 - the decoders' context (RoPE tables, dims) and doc line
from ..decoder import EMBEDDINGS, declare_embedding, declare_head  # noqa: F401 - HF's embedding names, read as the decoders'
from ..ops.linear import Proj, add_lora, frozen_weight, gather_rows, linear_forward, linear_group_forward
from ..ops.mlp import geglu_backward, geglu_forward
from ..ops.norm import rmsnorm_backward, rmsnorm_forward
from ..ops.rope import rope_backward, rope_forward
from ..spec import ModelSpec, count_field, lora_name, number_field
from . import no_train_extra
from . import llama

MODEL_TYPES = ("gemma2",)
HF_ARCHITECTURES = {"gemma2": "Gemma2ForCausalLM"}
TARGETS = llama.TARGETS
PEFT_LEFT_OUT: dict = {}
CONTEXT_LIMITED = True
PACKING_ISOLATED = True  # packed rows: position_ids restart RoPE and mask attention per document
RESIDUAL_IN_FP32 = False
train_extra = no_train_extra("gemma2")
weight_name = llama.weight_name
QKV, GATE_UP = ("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")
NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")


@dataclass(frozen=True)
class Gemma2Spec(ModelSpec):
    query_scalar: float = 256.0  # scores scaled by query_scalar ** -0.5
    attn_softcap: float | None = 50.0
    sliding_layers: tuple[int, ...] = ()  # layers with the window (HF layer_types "sliding_attention")


def spec_from_hf(cfg: dict) -> Gemma2Spec:
    llama.refuse_unsupported(cfg, act_key="hidden_activation", act="gelu_pytorch_tanh")
    for key in ("attention_bias", "use_bidirectional_attention"):
        if cfg.get(key):
            raise ValueError(f"unsupported config field {key}=True for gemma2")
    layers = count_field(cfg, "num_hidden_layers")
    types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    if len(types) != layers or not set(types) <= {"sliding_attention", "full_attention"}:
        raise ValueError(f"config.json field layer_types must be {layers} of sliding_attention/full_attention")
    window = count_field(cfg, "sliding_window", 4096)
    # absent: HF's defaults (50, 30); null: no soft-cap
    caps = {k: None if k in cfg and cfg[k] is None else number_field(cfg, k, default)
            for k, default in (("attn_logit_softcapping", 50.0), ("final_logit_softcapping", 30.0))}
    spec = llama.decoder_spec({**cfg, "use_sliding_window": False}, tied=bool(cfg.get("tie_word_embeddings", True)),
                              head_dim=count_field(cfg, "head_dim", 256))
    fields = {f: getattr(spec, f) for f in ModelSpec.__dataclass_fields__}
    fields.update(sliding_window=window, logit_softcap=caps["final_logit_softcapping"])
    return Gemma2Spec(**fields, query_scalar=number_field(cfg, "query_pre_attn_scalar", 256),
                      attn_softcap=caps["attn_logit_softcapping"],
                      sliding_layers=tuple(i for i, t in enumerate(types) if t == "sliding_attention"))


def required_tensors(config: dict) -> list:
    need = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.get("tie_word_embeddings", True):
        need.append("lm_head.weight")
    for i in range(int(config.get("num_hidden_layers", 0))):
        need += [weight_name(i, t) for t in TARGETS] + [f"model.layers.{i}.{n}.weight" for n in NORMS]
    return need


# -- the graph -------------------------------------------------------------------------------
@dataclass
class Layer:
    """Graph values of one layer: the four norms' (1 + w) scales and the projections."""
    idx: int
    norms: dict  # HF norm name -> 1 + w [D]
    proj: dict  # target -> Proj
    mask: Mask


@dataclass
class Saved:
    """What one layer's backward reads (kept by the forward, or recomputed with checkpointing;
    with checkpointing h1, h2 and act are recomputed: decoder.projection_inputs)."""
    h1: object  # input_layernorm output: q/k/v's input
    n1: object  # norm statistics, as norm.py keeps them
    att: AttentionSaved
    a2: object  # attention output [N, H Dh], o_proj's input
    n_attn: object  # post_attention_layernorm statistics (of o_proj's output)
    h2: object  # pre_feedforward_layernorm output: gate/up's input
    n2: object
    gate: object
    up: object
    act: object  # gelu_tanh(gate) * up: down_proj's input
    n_ffw: object  # post_feedforward_layernorm statistics (of down_proj's output)
    u: dict  # target -> s x A^T of its LoRA (None if not adapted)


def _scale(g, w, n: int):
    """1 + w, the Gemma RMSNorm scale, with its shape stated (norm.py reads D from it)."""
    v = g.op("Add", w, g.f(1.0))
    v.shape, v.type = ir.Shape([n]), ir.TensorType(g.float)
    return v


def declare_weights(g, spec: Gemma2Spec, train):
    D = spec.hidden
    embed_w = declare_embedding(g, spec, train)
    trained = set(train.layers(spec))
    layers = []
    for i in range(spec.layers):
        norms = {n: _scale(g, g.input(f"model.layers.{i}.{n}.weight", [D]), D) for n in NORMS}
        mask = Mask(softcap=spec.attn_softcap, window=spec.sliding_window if i in spec.sliding_layers else None)
        L = Layer(i, norms, {}, mask)
        for t in TARGETS:
            out, inp = spec.proj_shape(t)
            L.proj[t] = p = Proj(frozen_weight(g, train, weight_name(i, t), out, inp))
            if i in trained and t in train.lora_targets:
                add_lora(g, p, lambda which: lora_name(i, t, which), train, out, inp)
        layers.append(L)
    final_norm = _scale(g, g.input("model.norm.weight", [D]), D)
    return embed_w, layers, final_norm, declare_head(g, spec, train, embed_w)


def embed(g, table, ids, spec, train):
    """Rows of the frozen table times sqrt(D) (HF's Gemma2TextScaledWordEmbedding) -> [N, D]."""
    rows = gather_rows(g, table, ids, train.batch * train.seq, spec.hidden)
    return g.op("Mul", rows, g.f(math.sqrt(spec.hidden)))


def layer_forward(c: Ctx, x, L: Layer):
    """x [N, D] -> (x_out [N, D], Saved)."""
    g, spec = c.g, c.spec
    B, K, G, S, Dh = c.dims
    N, H, eps = B * S, K * G, spec.rms_eps
    h1, n1 = rmsnorm_forward(g, x, L.norms["input_layernorm"], eps)
    (q, k, v), u_qkv = linear_group_forward(g, h1, [L.proj[t] for t in QKV])
    qr = rope_forward(g, g.reshape(q, B, S, H, Dh), c.cos, c.sin, Dh)
    kr = rope_forward(g, g.reshape(k, B, S, K, Dh), c.cos, c.sin, Dh)
    att, sa = attention_forward(g, qr, kr, g.reshape(v, B, S, K, Dh), c.dims, scale=spec.query_scalar ** -0.5,
                                mask=L.mask, positions=c.positions)
    a2 = g.reshape(att, N, H * Dh)
    o, u_o = linear_forward(g, a2, L.proj["o_proj"])
    po, n_attn = rmsnorm_forward(g, o, L.norms["post_attention_layernorm"], eps)
    x1 = g.op("Add", x, po)
    h2, n2 = rmsnorm_forward(g, x1, L.norms["pre_feedforward_layernorm"], eps)
    (gate, up), u_gu = linear_group_forward(g, h2, [L.proj[t] for t in GATE_UP])
    act = geglu_forward(g, gate, up)
    dn, u_dn = linear_forward(g, act, L.proj["down_proj"])
    pf, n_ffw = rmsnorm_forward(g, dn, L.norms["post_feedforward_layernorm"], eps)
    u = dict(zip(QKV + GATE_UP, u_qkv + u_gu), o_proj=u_o, down_proj=u_dn)
    return g.op("Add", x1, pf), Saved(h1, n1, sa, a2, n_attn, h2, n2, gate, up, act, n_ffw, u)


def layer_backward(c: Ctx, dy, L: Layer, s: Saved, need_dx: bool, grads: dict):
    """dy = dLoss/d x_out [N, D] -> dLoss/d x_in (None if not needed); LoRA grads into `grads`."""
    g = c.g
    B, K, G, S, Dh = c.dims
    N, H = B * S, K * G

    proj_back, group_back = lora_backward(g, grads, L, s)

    h1, h2, act = projection_inputs(g, s, L.norms["input_layernorm"], L.norms["pre_feedforward_layernorm"],
                                    geglu_forward, lean=c.train.checkpointing, fresh=c.fresh)
    # MLP block: x_out = x1 + post_ffw_norm(down(geglu(gate(h2), up(h2)))), h2 = pre_ffw_norm(x1)
    ddn = rmsnorm_backward(g, dy, L.norms["post_feedforward_layernorm"], s.n_ffw)
    dgate, dup = geglu_backward(g, proj_back(ddn, act, "down_proj"), s.gate, s.up)
    dh2 = group_back([dgate, dup], h2, GATE_UP)
    dx1 = g.op("Add", dy, rmsnorm_backward(g, dh2, L.norms["pre_feedforward_layernorm"], s.n2))
    # attention block: x1 = x + post_attn_norm(o(attn(rope(q), rope(k), v))), q, k, v from in_norm(x)
    do = rmsnorm_backward(g, dx1, L.norms["post_attention_layernorm"], s.n_attn)
    da2 = proj_back(do, s.a2, "o_proj")
    dqr, dkr, dv = attention_backward(g, g.reshape(da2, B, S, H, Dh), s.att, c.dims)
    dq = g.reshape(rope_backward(g, dqr, c.cos, c.sin, Dh), N, H * Dh)
    dk = g.reshape(rope_backward(g, dkr, c.cos, c.sin, Dh), N, K * Dh)
    dh1 = group_back([dq, dk, g.reshape(dv, N, K * Dh)], h1, QKV, need_dx)
    if not need_dx:
        return None
    return g.op("Add", dx1, rmsnorm_backward(g, dh1, L.norms["input_layernorm"], s.n1))


def lora_tensor_names(spec: Gemma2Spec, train) -> list[str]:
    """Every LoRA tensor of the graph in output order: by layer, target, then A before B."""
    return [lora_name(i, t, w) for i in train.layers(spec) for t in TARGETS if t in train.lora_targets
            for w in ("A", "B")]


# -- llama.cpp GGUF ----------------------------------------------------------------------
GGUF_ARCHS = {"gemma2": "gemma2"}
GGUF_LAYER_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
                    "post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                    "post_ffw_norm": "post_feedforward_layernorm"}
GGUF_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
GGUF_TARGETS = llama.GGUF_TARGETS


def config_from_gguf(meta, tensor_names) -> dict:
    config = llama.decoder_config(meta, tensor_names, "gemma2", "Gemma2ForCausalLM")
    del config["hidden_act"]
    layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
    # llama.cpp keeps no query_pre_attn_scalar: it scales by head_dim^-1/2, and by
    # (hidden/heads)^-1/2 for the 46-layer 27B model, whose config says hidden/heads
    scalar = config["hidden_size"] // heads if layers == 46 else config["head_dim"]
    config.update(hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=scalar,
                  sliding_window=meta.count("attention.sliding_window", 4096),
                  attn_logit_softcapping=meta.number("attn_logit_softcapping", None),
                  final_logit_softcapping=meta.number("final_logit_softcapping", None))
    return config


def tensor_from_gguf(name: str, w, config: dict):
    # convert_hf_to_gguf writes Gemma's norm weights as 1 + w
    return w - 1 if name.endswith("norm.weight") else w


def gguf_export(config: dict):
    return "gemma2", {}


def activation_bytes(spec, itemsize: int):
    """None: soft-capped attention scores are not cuDNN's fused unit, so the step keeps score
    matrices the memory model of runtime/train/memory.py leaves out."""
    return None

