"""Mamba-1 (HF `MambaForCausalLM`): the selective state-space family. Spec in
graphs/mamba_spec.py, layer in graphs/mamba.py (docs/MAMBA.md).

HF names: backbone.embeddings, backbone.layers.N.{norm, mixer.{in_proj, conv1d, x_proj,
dt_proj, A_log, D, out_proj}}, backbone.norm_f, lm_head (absent when tied). No GGUF:
lorac loads Mamba from HF directories only and exports merged models or PEFT adapters.
"""
from __future__ import annotations

from ..mamba import DEFAULT_CHUNK, DEVICE_CHUNK, EMBEDDINGS, Ctx, declare_weights, describe, embed  # noqa: F401
from ..mamba import layer_backward, layer_forward, lora_tensor_names  # noqa: F401
from ..mamba_spec import MAMBA_TARGETS, MambaSpec, lora_name
from ..mamba_spec import weight_name as _weight_name
from . import no_gguf_export

MODEL_TYPES = ("mamba",)
HF_ARCHITECTURES = {"mamba": "MambaForCausalLM"}
TARGETS = MAMBA_TARGETS
CONTEXT_LIMITED = False  # no position embeddings: any --seq
PACKING_ISOLATED = False  # the conv and scan would need their state reset at document starts
RESIDUAL_IN_FP32 = True  # HF MambaConfig.residual_in_fp32 (default True): the stream stays fp32
# targets a PEFT adapter leaves out, and why (both measured; docs/MAMBA.md "Export"). The
# merged export carries them. transformers 5.x MambaMixer.forward: `self.dt_proj.weight @ time_step`.
PEFT_LEFT_OUT = {
    "dt_proj": "transformers' Mamba forward reads dt_proj.weight directly, so a PEFT LoRA there has no effect",
    "out_proj": "PEFT 0.21 refuses it on Mamba models",
}
spec_from_hf = MambaSpec.from_hf_config


def weight_name(layer: int, target: str) -> str:
    return _weight_name(layer, f"{target}.weight")


def required_tensors(config: dict) -> list:
    need = ["backbone.embeddings.weight", "backbone.norm_f.weight"]
    if not config.get("tie_word_embeddings", True):
        need.append("lm_head.weight")
    mixer = ["in_proj.weight", "x_proj.weight", "dt_proj.weight", "dt_proj.bias", "out_proj.weight",
             "conv1d.weight", "A_log", "D"]
    mixer += ["conv1d.bias"] if config.get("use_conv_bias", True) else []
    mixer += ["in_proj.bias", "out_proj.bias"] if config.get("use_bias", False) else []
    for i in range(int(config.get("num_hidden_layers", 0))):
        need += [f"backbone.layers.{i}.norm.weight"] + [f"backbone.layers.{i}.mixer.{m}" for m in mixer]
    return need


def train_extra(target: str, scan_chunk: int) -> dict:
    """The scan chunk length: the user's, else the device's default (graphs/mamba.py)."""
    return {"scan_chunk": scan_chunk or DEVICE_CHUNK.get(target, DEFAULT_CHUNK)}


GGUF_ARCHS: dict = {}
GGUF_LAYER_NAMES: dict = {}
GGUF_GLOBAL_NAMES: dict = {}
GGUF_TARGETS: dict = {}
gguf_export = no_gguf_export("mamba")


def config_from_gguf(meta, tensor_names) -> dict:
    raise ValueError("lorac reads Mamba models from HF directories only")


def tensor_from_gguf(name: str, w, config: dict):
    return w


def activation_bytes(spec, itemsize: int):
    """Bytes a token a trained layer keeps (runtime/train/memory.py; measured on compiled CUDA
    plans): ~18 [T, I] values kept or not (no lean set), the fp32 residual input when
    recomputed, and the scan's gradients (8 [T, I]) in the backward."""
    full = 18 * spec.intermediate * itemsize
    return full, full, 4.5 * spec.hidden, 8 * spec.intermediate * itemsize

