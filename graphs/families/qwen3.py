"""Qwen3: a Llama-like decoder with RMSNorm over head_dim on q and k before RoPE (QK-norm),
no attention biases, head_dim given in the config. The layer is graphs/decoder.py.

HF names: those of llama.py plus model.layers.N.self_attn.{q_norm,k_norm}; llama.cpp
architecture qwen3 (attn_q_norm, attn_k_norm; q/k rows not permuted).
"""
from __future__ import annotations

from ..decoder import declare_weights, describe, embed, layer_backward, layer_forward, Ctx  # noqa: F401
from ..decoder import EMBEDDINGS, lora_tensor_names  # noqa: F401
from ..decoder import (attention_state, layer_refill, mlp_state, mlp_state_bytes,  # noqa: F401 - offload_state (compose.py)
                       offload_state_bytes, state_offload_pays)
from ..decoder import activation_bytes  # noqa: F401 - what a layer keeps, q/k norms included
from ..spec import ModelSpec, lora_name  # noqa: F401
from . import no_train_extra
from . import llama

MODEL_TYPES = ("qwen3",)
HF_ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM"}
TARGETS = llama.TARGETS
PEFT_LEFT_OUT: dict = {}
CONTEXT_LIMITED = True
PACKING_ISOLATED = True  # packed rows: position_ids restart RoPE and mask attention per document
RESIDUAL_IN_FP32 = False
train_extra = no_train_extra("qwen3")
weight_name = llama.weight_name


def spec_from_hf(cfg: dict) -> ModelSpec:
    llama.refuse_unsupported(cfg)
    if cfg.get("attention_bias"):
        raise ValueError("unsupported config field attention_bias=True for qwen3")
    return llama.decoder_spec(cfg, qk_norm=True)


def required_tensors(config: dict) -> list:
    return llama.required_tensors(config, extra=("self_attn.q_norm", "self_attn.k_norm"))


GGUF_ARCHS = {"qwen3": "qwen3"}
GGUF_LAYER_NAMES = llama.GGUF_LAYER_NAMES
GGUF_GLOBAL_NAMES = llama.GGUF_GLOBAL_NAMES
GGUF_TARGETS = llama.GGUF_TARGETS


def config_from_gguf(meta, tensor_names) -> dict:
    return llama.decoder_config(meta, tensor_names, "qwen3", "Qwen3ForCausalLM")


def tensor_from_gguf(name: str, w, config: dict):
    return w  # llama.cpp runs Qwen3 with the NeoX (HF) rotation: rows as HF has them


def gguf_export(config: dict):
    return "qwen3", {}
