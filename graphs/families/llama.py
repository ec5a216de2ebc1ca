"""Llama-like decoders: Llama, Mistral, Qwen2 (RMSNorm, RoPE, GQA, SwiGLU; q/k/v biases
on Qwen2 or with attention_bias). The layer itself is graphs/decoder.py, shared with qwen3.

HF names: model.embed_tokens, model.layers.N.{self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj,
input_layernorm, post_attention_layernorm}, model.norm, lm_head (absent when tied).
llama.cpp: architectures llama (Mistral 7B files too) and qwen2; its converter permutes
the rows of q_proj/k_proj inside each head for llama (runtime/model/gguf.py).
"""
from __future__ import annotations

from ..decoder import declare_weights, describe, embed, layer_backward, layer_forward, Ctx  # noqa: F401
from ..decoder import EMBEDDINGS, lora_tensor_names  # noqa: F401
from ..decoder import (attention_state, layer_refill, mlp_state, mlp_state_bytes,  # noqa: F401 - offload_state (compose.py)
                       offload_state_bytes, state_offload_pays)
from ..decoder import activation_bytes  # noqa: F401 - what a layer keeps (runtime/train/memory.py)
from ..spec import ATTN_TARGETS, MLP_TARGETS, ModelSpec, count_field, first, lora_name, number_field, rope_theta
from ..spec import weight_name as _weight_name
from . import no_train_extra

MODEL_TYPES = ("llama", "mistral", "qwen2")
HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
TARGETS = ATTN_TARGETS + MLP_TARGETS
PEFT_LEFT_OUT: dict = {}
CONTEXT_LIMITED = True
PACKING_ISOLATED = True  # packed rows: position_ids restart RoPE and mask attention per document
RESIDUAL_IN_FP32 = False  # bf16 builds may store the residual stream in bf16, as transformers does
train_extra = no_train_extra("this model")


def spec_from_hf(cfg: dict) -> ModelSpec:
    refuse_unsupported(cfg)
    return decoder_spec(cfg)


def decoder_spec(cfg: dict, **fixed) -> ModelSpec:
    """The ModelSpec fields every RMSNorm + RoPE decoder config spells alike; `fixed` sets
    what a family decides itself (qk_norm=True for qwen3)."""
    arch = cfg.get("model_type")
    hidden, heads = count_field(cfg, "hidden_size"), count_field(cfg, "num_attention_heads")
    kv = count_field(cfg, "num_key_value_heads", heads) if cfg.get("num_key_value_heads") is not None else heads
    head_dim = count_field(cfg, "head_dim") if cfg.get("head_dim") is not None else hidden // heads
    if head_dim < 1:
        raise ValueError(f"config.json: hidden_size={hidden} is smaller than num_attention_heads={heads}")
    if head_dim % 2:
        raise ValueError(f"head_dim={head_dim} must be even (RoPE rotates pairs of dimensions)")
    if heads % kv:
        raise ValueError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}")
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", arch in ("mistral", "phi3")) else None
    if window is not None and arch == "qwen2":  # HF windows only the layers from max_window_layers up
        raise ValueError("unsupported config field use_sliding_window=True for qwen2 (windows on some layers)")
    bias = bool(cfg.get("attention_bias", False))
    fields = dict(
        arch=arch, vocab=count_field(cfg, "vocab_size"), hidden=hidden, layers=count_field(cfg, "num_hidden_layers"),
        heads=heads, kv_heads=kv, head_dim=head_dim, intermediate=count_field(cfg, "intermediate_size"),
        rope_theta=rope_theta(cfg),
        rms_eps=number_field(cfg, "rms_norm_eps", 1e-6),
        tied=bool(cfg.get("tie_word_embeddings", arch != "llama" and arch != "mistral")),
        qkv_bias=arch == "qwen2" or bias, o_bias=bias and arch != "qwen2",
        sliding_window=count_field(cfg, "sliding_window") if window is not None else None,
        bos_id=cfg.get("bos_token_id"), eos_id=first(cfg.get("eos_token_id")),
    )
    return ModelSpec(**{**fields, **fixed})


def refuse_unsupported(cfg: dict, act_key: str = "hidden_act", act: str = "silu") -> None:
    """Every config field of an RMSNorm + RoPE decoder that would change the math lorac computes."""
    got = cfg.get(act_key, act)
    if got != act:
        raise ValueError(f"unsupported config field {act_key}={got!r} (only {act!r})")
    for key in ("rope_scaling", "rope_parameters"):
        rs = cfg.get(key) or {}
        if not isinstance(rs, dict):
            raise ValueError(f"config.json field {key} must be an object, got {type(rs).__name__}")
        kind = rs.get("rope_type", rs.get("type", "default"))
        if kind != "default":
            raise ValueError(f"unsupported config field {key}: rope_type={kind!r} (only plain RoPE)")
        if rs.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(f"unsupported config field {key}: partial_rotary_factor={rs['partial_rotary_factor']}")
    if cfg.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"unsupported config field partial_rotary_factor={cfg['partial_rotary_factor']}")
    if cfg.get("mlp_bias"):
        raise ValueError("unsupported config field mlp_bias=True")
    if cfg.get("pretraining_tp", 1) not in (1, None):
        raise ValueError(f"unsupported config field pretraining_tp={cfg['pretraining_tp']}")
    layer_types = cfg.get("layer_types")
    if layer_types is not None and not isinstance(layer_types, list):
        raise ValueError(f"config.json field layer_types must be a list, got {type(layer_types).__name__}")
    if layer_types and any(t != "full_attention" for t in layer_types) and cfg.get("use_sliding_window"):
        raise ValueError("unsupported config field layer_types: sliding-window layers are not implemented")


def weight_name(layer: int, target: str) -> str:
    return _weight_name(layer, target)


def required_tensors(config: dict, extra: tuple = ()) -> list:
    """HF tensors of a Llama-like checkpoint; `extra` names more modules of every layer."""
    need = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.get("tie_word_embeddings", False):
        need.append("lm_head.weight")
    mods = [f"self_attn.{t}" for t in ATTN_TARGETS] + [f"mlp.{t}" for t in MLP_TARGETS]
    mods += ["input_layernorm", "post_attention_layernorm", *extra]
    for i in range(int(config.get("num_hidden_layers", 0))):
        need += [f"model.layers.{i}.{m}.weight" for m in mods]
        if config.get("model_type") == "qwen2" or config.get("attention_bias"):
            need += [f"model.layers.{i}.self_attn.{m}.bias" for m in ("q_proj", "k_proj", "v_proj")]
        if config.get("attention_bias") and config.get("model_type") != "qwen2":  # the graph's o_bias
            need.append(f"model.layers.{i}.self_attn.o_proj.bias")
    return need


# -- llama.cpp GGUF ----------------------------------------------------------------------
GGUF_ARCHS = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2"}
GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
GGUF_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
GGUF_TARGETS = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
                "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
PERMUTED = ("llama", "mistral")  # model types whose q/k rows llama.cpp's converter permutes


def config_from_gguf(meta, tensor_names) -> dict:
    model_type = GGUF_ARCHS[meta.arch]
    # llama.cpp writes Mistral 7B files as "llama"; the name is the only trace left
    if meta.arch == "llama" and "mistral" in str(meta.meta.get("general.name", "")).lower():
        model_type = "mistral"
    return decoder_config(meta, tensor_names, model_type, HF_ARCHITECTURES[model_type])


def decoder_config(meta, tensor_names, model_type: str, architecture: str) -> dict:
    """GGUF metadata of an RMSNorm + RoPE decoder -> the config.json HF would have."""
    hidden = meta.count("embedding_length")
    heads = meta.count("attention.head_count")
    # key_length is written when head_dim != hidden/heads (Qwen3); else it is implied
    return {
        "model_type": model_type, "architectures": [architecture],
        "hidden_size": hidden, "num_hidden_layers": meta.count("block_count"),
        "num_attention_heads": heads, "num_key_value_heads": meta.count("attention.head_count_kv", heads),
        "head_dim": meta.count("attention.key_length", max(hidden // heads, 1)),
        "intermediate_size": meta.count("feed_forward_length"),
        "rms_norm_eps": meta.number("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": meta.number("rope.freq_base", 10000.0),  # llama.cpp's own default
        "max_position_embeddings": meta.count("context_length", 2048),
        "vocab_size": meta.vocab(),
        "tie_word_embeddings": "output.weight" not in set(tensor_names),
        "hidden_act": "silu", "torch_dtype": "float32", **meta.token_ids(),
    }


def unpermute_qk(w, n_head: int):
    """Undo llama.cpp's RoPE row order on q_proj/k_proj rows (weights [out, in] or bias [out]).

    Per head of d rows the file holds row 2i + h for HF row h*d/2 + i (h in {0, 1}); viewing
    the rows as [head, i, h] and swapping to [head, h, i] restores HF's order.
    """
    d = w.shape[0] // n_head
    return w.reshape(n_head, d // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tensor_from_gguf(name: str, w, config: dict):
    if config["model_type"] not in PERMUTED:
        return w
    if name.endswith(("q_proj.weight", "q_proj.bias")):
        return unpermute_qk(w, config["num_attention_heads"])
    if name.endswith(("k_proj.weight", "k_proj.bias")):
        return unpermute_qk(w, config["num_key_value_heads"])
    return w


def gguf_export(config: dict):
    """(llama.cpp architecture, {target: heads}) with the q/k rows llama.cpp permutes."""
    arch = (config.get("architectures") or [HF_ARCHITECTURES.get(config.get("model_type"), "?")])[0]
    model_type = {v: k for k, v in HF_ARCHITECTURES.items()}.get(arch, config.get("model_type"))
    if model_type not in PERMUTED:
        return model_type, {}
    n_head = int(config["num_attention_heads"])
    return "llama", {"q_proj": n_head, "k_proj": int(config.get("num_key_value_heads") or n_head)}
