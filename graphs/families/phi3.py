"""Phi-3 (HF `Phi3ForCausalLM`): a Llama-like decoder whose q/k/v and gate/up projections
are fused into one matrix each, so LoRA adapts the fused matrices.

Shape legend: B batch, S seq, N = B*S tokens, D hidden, H heads, K kv heads, G = H/K,
Dh head dim, I intermediate, r LoRA rank.

One layer (HF Phi3DecoderLayer, eval mode: no dropout):
    h1 = rmsnorm(x);  [q | k | v] = qkv_proj(h1)                 [N, (H + 2K) Dh]
    x1 = x + o_proj(attn(rope(q), rope(k), v))                   (a sliding window when set)
    h2 = rmsnorm(x1); [gate | up] = gate_up_proj(h2)             [N, 2I], gate first
    x_out = x1 + down_proj(silu(gate) * up)
The backward concatenates the slices' gradients into the fused one, [dq | dk | dv] and
[dgate | dup], and runs one linear backward (graphs/ops/linear.py) per fused projection: the
LoRA on qkv_proj is one A [r, D] and one B [(H + 2K) Dh, r], as PEFT holds it.

Names: HF model.layers.N.self_attn.{qkv_proj, o_proj}, mlp.{gate_up_proj, down_proj},
input_layernorm, post_attention_layernorm. llama.cpp (architecture phi3) keeps both fusions:
qkv_proj is blk.N.attn_qkv and gate_up_proj is blk.N.ffn_up ([2I, D], gate rows first, as
its SwiGLU splits it), so neither the GGUF loader nor the GGUF LoRA export splits anything;
the rows are not permuted (llama.cpp runs Phi-3 with the NeoX, i.e. HF, rotation).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..ops.attention import AttentionSaved, Mask, attention_backward, attention_forward
from ..decoder import Ctx, describe, embed, gated_mlp_backward, projection_inputs, recomputed_mlp_tail  # noqa: F401 - the decoders' context, embedding and doc line
from ..decoder import EMBEDDINGS, declare_embedding, declare_head  # noqa: F401 - HF's embedding names, read as the decoders'
from ..decoder import activation_bytes as _decoder_bytes
from ..ops.linear import Proj, add_lora, frozen_weight, linear_forward, projection_backward
from ..ops.mlp import swiglu_forward
from ..ops.norm import rmsnorm_backward, rmsnorm_forward
from ..ops.rope import rope_backward, rope_forward
from ..spec import ModelSpec, count_field, number_field
from . import no_train_extra
from . import llama

MODEL_TYPES = ("phi3",)
HF_ARCHITECTURES = {"phi3": "Phi3ForCausalLM"}
TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
BLOCK = {"qkv_proj": "self_attn", "o_proj": "self_attn", "gate_up_proj": "mlp", "down_proj": "mlp"}
PEFT_LEFT_OUT: dict = {}
CONTEXT_LIMITED = True
PACKING_ISOLATED = True  # packed rows: position_ids restart RoPE and mask attention per document
RESIDUAL_IN_FP32 = False
train_extra = no_train_extra("phi3")


@dataclass(frozen=True)
class Phi3Spec(ModelSpec):
    @property
    def targets(self) -> tuple[str, ...]:
        return TARGETS

    def proj_shape(self, target: str) -> tuple[int, int]:
        d, hd = self.hidden, self.head_dim
        return {"qkv_proj": ((self.heads + 2 * self.kv_heads) * hd, d), "o_proj": (d, self.heads * hd),
                "gate_up_proj": (2 * self.intermediate, d), "down_proj": (d, self.intermediate)}[target]


def spec_from_hf(cfg: dict) -> Phi3Spec:
    llama.refuse_unsupported(cfg)
    if cfg.get("attention_bias"):
        raise ValueError("unsupported config field attention_bias=True for phi3")
    spec = llama.decoder_spec(cfg, tied=bool(cfg.get("tie_word_embeddings", False)),
                              rms_eps=number_field(cfg, "rms_norm_eps", 1e-5))
    if cfg.get("head_dim") is not None and count_field(cfg, "head_dim") * spec.heads != spec.hidden:
        raise ValueError(f"unsupported config field head_dim={cfg['head_dim']} (Phi-3 has hidden_size/heads)")
    return Phi3Spec(**{f: getattr(spec, f) for f in spec.__dataclass_fields__})


def lora_name(layer: int, target: str, which: str) -> str:
    return f"base_model.model.model.layers.{layer}.{BLOCK[target]}.{target}.lora_{which}.weight"


def weight_name(layer: int, target: str) -> str:
    return f"model.layers.{layer}.{BLOCK[target]}.{target}.weight"


def required_tensors(config: dict) -> list:
    need = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.get("tie_word_embeddings", False):
        need.append("lm_head.weight")
    for i in range(int(config.get("num_hidden_layers", 0))):
        need += [weight_name(i, t) for t in TARGETS]
        need += [f"model.layers.{i}.{m}.weight" for m in ("input_layernorm", "post_attention_layernorm")]
    return need


# -- the graph -------------------------------------------------------------------------------
@dataclass
class Layer:
    """Graph values of one layer's weights."""
    idx: int
    in_norm: object
    post_norm: object
    proj: dict  # target -> Proj


@dataclass
class Saved:
    """What one layer's backward reads (kept by the forward, or recomputed with checkpointing;
    with checkpointing h1, h2 and act are recomputed: decoder.projection_inputs)."""
    h1: object  # input_layernorm output, qkv_proj's input
    n1: object  # its norm statistics
    att: AttentionSaved
    a2: object  # attention output [N, H Dh], o_proj's input
    h2: object  # post_attention_layernorm output, gate_up_proj's input
    n2: object
    gate: object
    up: object
    act: object  # silu(gate) * up, down_proj's input
    u: dict  # target -> s x A^T of its LoRA (None if not adapted)


def declare_weights(g, spec: Phi3Spec, train):
    embed_w = declare_embedding(g, spec, train)
    trained = set(train.layers(spec))
    layers = []
    for i in range(spec.layers):
        norm = lambda name: g.input(f"model.layers.{i}.{name}.weight", [spec.hidden])
        L = Layer(i, norm("input_layernorm"), norm("post_attention_layernorm"), {})
        for t in TARGETS:
            out, inp = spec.proj_shape(t)
            L.proj[t] = p = Proj(frozen_weight(g, train, weight_name(i, t), out, inp))
            if i in trained and t in train.lora_targets:
                add_lora(g, p, lambda which: lora_name(i, t, which), train, out, inp)
        layers.append(L)
    final_norm = g.input("model.norm.weight", [spec.hidden])
    return embed_w, layers, final_norm, declare_head(g, spec, train, embed_w)


def layer_forward(c: Ctx, x, L: Layer):
    """x [N, D] -> (x_out [N, D], Saved)."""
    g, spec = c.g, c.spec
    B, K, G, S, Dh = c.dims
    N, H, I = B * S, K * G, spec.intermediate
    h1, n1 = rmsnorm_forward(g, x, L.in_norm, spec.rms_eps)
    qkv, u_qkv = linear_forward(g, h1, L.proj["qkv_proj"])
    q = g.reshape(g.slice(qkv, 0, H * Dh, 1), B, S, H, Dh)
    k = g.reshape(g.slice(qkv, H * Dh, (H + K) * Dh, 1), B, S, K, Dh)
    v = g.reshape(g.slice(qkv, (H + K) * Dh, (H + 2 * K) * Dh, 1), B, S, K, Dh)
    att, sa = attention_forward(g, rope_forward(g, q, c.cos, c.sin, Dh), rope_forward(g, k, c.cos, c.sin, Dh), v,
                                c.dims, mask=Mask(window=spec.sliding_window), positions=c.positions)
    a2 = g.reshape(att, N, H * Dh)
    o, u_o = linear_forward(g, a2, L.proj["o_proj"])
    x1 = g.op("Add", x, o)
    h2, n2 = rmsnorm_forward(g, x1, L.post_norm, spec.rms_eps)
    gu, u_gu = linear_forward(g, h2, L.proj["gate_up_proj"])
    gate, up = g.slice(gu, 0, I, 1), g.slice(gu, I, 2 * I, 1)
    u = {"qkv_proj": u_qkv, "o_proj": u_o, "gate_up_proj": u_gu}
    if c.recomputing:  # as the decoder's: the backward forms silu(gate) * up and down_proj's u
        return None, Saved(h1, n1, sa, a2, h2, n2, gate, up, None, recomputed_mlp_tail(u))
    act = swiglu_forward(g, gate, up)
    dn, u["down_proj"] = linear_forward(g, act, L.proj["down_proj"])
    return g.op("Add", x1, dn), Saved(h1, n1, sa, a2, h2, n2, gate, up, act, u)


def layer_backward(c: Ctx, dy, L: Layer, s: Saved, need_dx: bool, grads: dict):
    """dy = dLoss/d x_out [N, D] -> dLoss/d x_in (None if not needed); LoRA grads into `grads`."""
    g = c.g
    B, K, G, S, Dh = c.dims
    N, H = B * S, K * G

    def proj_back(dout, x, t, want_dx=True):
        names = lora_name(L.idx, t, "A"), lora_name(L.idx, t, "B")
        return projection_backward(g, grads, names, dout, x, s.u[t], L.proj[t], want_dx)

    h1, h2, act = projection_inputs(g, s, L.in_norm, L.post_norm, None, lean=c.train.checkpointing, fresh=c.fresh)
    # MLP block: x_out = x1 + down(swiglu(gate, up)), [gate | up] = gate_up(norm(x1))
    dgate, dup = gated_mlp_backward(g, proj_back, dy, s, act)
    dh2 = proj_back(g.op("Concat", dgate, dup, axis=1), h2, "gate_up_proj")
    dx1 = g.op("Add", dy, rmsnorm_backward(g, dh2, L.post_norm, s.n2))
    # attention block: x1 = x + o(attn(rope(q), rope(k), v)), [q | k | v] = qkv(norm(x))
    da2 = proj_back(dx1, s.a2, "o_proj")
    dqr, dkr, dv = attention_backward(g, g.reshape(da2, B, S, H, Dh), s.att, c.dims)
    dq = g.reshape(rope_backward(g, dqr, c.cos, c.sin, Dh), N, H * Dh)
    dk = g.reshape(rope_backward(g, dkr, c.cos, c.sin, Dh), N, K * Dh)
    dh1 = proj_back(g.op("Concat", dq, dk, g.reshape(dv, N, K * Dh), axis=1), h1, "qkv_proj", need_dx)
    if not need_dx:
        return None
    return g.op("Add", dx1, rmsnorm_backward(g, dh1, L.in_norm, s.n1))


def lora_tensor_names(spec: Phi3Spec, train) -> list[str]:
    """Every LoRA tensor of the graph in output order: by layer, target, then A before B."""
    return [lora_name(i, t, w) for i in train.layers(spec) for t in TARGETS if t in train.lora_targets
            for w in ("A", "B")]


# -- llama.cpp GGUF ----------------------------------------------------------------------
GGUF_ARCHS = {"phi3": "phi3"}
GGUF_LAYER_NAMES = {"attn_norm": "input_layernorm", "attn_qkv": "self_attn.qkv_proj",
                    "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
                    "ffn_up": "mlp.gate_up_proj", "ffn_down": "mlp.down_proj"}
GGUF_GLOBAL_NAMES = llama.GGUF_GLOBAL_NAMES
GGUF_TARGETS = {"qkv_proj": "attn_qkv", "o_proj": "attn_output", "gate_up_proj": "ffn_up", "down_proj": "ffn_down"}


def config_from_gguf(meta, tensor_names) -> dict:
    config = llama.decoder_config(meta, tensor_names, "phi3", "Phi3ForCausalLM")
    config["rms_norm_eps"] = meta.number("attention.layer_norm_rms_epsilon", 1e-5)
    rope_dims = meta.count("rope.dimension_count", config["head_dim"])
    if rope_dims != config["head_dim"]:  # Phi-4-mini: partial_rotary_factor < 1
        raise ValueError(f"GGUF metadata phi3.rope.dimension_count={rope_dims}: partial rotary embeddings "
                         "are not implemented")
    window = meta.get("attention.sliding_window", 0)  # 0: none (the converter's mark for Phi-4)
    config["sliding_window"] = int(window) if window else None
    return config


def tensor_from_gguf(name: str, w, config: dict):
    return w


def gguf_export(config: dict):
    return "phi3", {}


def activation_bytes(spec, itemsize: int):
    """The decoder's, with the fused qkv and gate_up outputs kept beside their parts and
    gate_up's gradient in the backward (runtime/train/memory.py)."""
    I = spec.intermediate
    return _decoder_bytes(spec, itemsize, lean_extra=spec.hidden, full_extra=2 * I, backward_extra=2 * I)

