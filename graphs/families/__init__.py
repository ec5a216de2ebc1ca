"""The model families lorac trains: one module per family in this package, found by name.

Everything that differs between families is asked of the family module; the rest of
lorac (graphs/compose.py, runtime/model/weights.py, runtime/model/gguf.py, export.py, train.py) never
branches on a family name. Adding a family = one module here + its tests + a docs row.

A family module defines (llama.py is the model to copy):

  MODEL_TYPES        HF config.json `model_type` values it reads
  HF_ARCHITECTURES   {model_type: "XForCausalLM"} (config.json `architectures`)
  TARGETS            its LoRA targets (HF module names), in graph order
  spec_from_hf(cfg)  -> its spec (a ValueError naming any field lorac does not implement)
  -- the graph (graphs/compose.py composes these): declare_weights, Ctx, embed,
     layer_forward, layer_backward, lora_tensor_names, describe
  -- names and tensors
  EMBEDDINGS         (input embedding, untied LM head): HF names of the [V, D] tables
                     (--quantize-embeddings quantizes them: runtime/model/quant/embeddings.py)
  lora_name(layer, target, which)   PEFT's saved key, which in {"A", "B"}
  weight_name(layer, target)        HF's key of the adapted matrix
  required_tensors(config)          HF tensor names a checkpoint of `config` must hold
  PEFT_LEFT_OUT      {target: why} targets a PEFT adapter cannot carry ({} if none)
  -- llama.cpp GGUF
  GGUF_ARCHS         {general.architecture: model_type} it loads ({} if none)
  config_from_gguf(meta: GgufMeta, tensor_names) -> the HF config dict
  GGUF_LAYER_NAMES   {per-layer GGUF stem: HF module path in the layer}
  GGUF_GLOBAL_NAMES  {GGUF stem: HF module path}
  tensor_from_gguf(hf_name, array, config) -> the array as HF holds it
  GGUF_TARGETS       {target: GGUF stem} of the adapted matrices (GGUF LoRA export)
  gguf_export(config) -> (llama.cpp architecture, {target: heads whose q/k rows llama.cpp
                      permutes}), or a ValueError when llama.cpp has no such model
  -- training
  train_extra(target, scan_chunk) -> TrainSpec.extra for this family (ValueError for
                      options it has no use for)
  CONTEXT_LIMITED    whether max_position_embeddings bounds --seq
  PACKING_ISOLATED   whether --packing isolated is implemented (its graph takes position_ids)
  RESIDUAL_IN_FP32   whether its reference keeps the residual stream in fp32 in bf16 models
                     (the graph's metadata then tells the compiler: compiler/passes/residual_stream.py)
  activation_bytes(spec, itemsize) -> bytes a token a trained layer of the compiled step
                     keeps (full, lean, recomputed, backward), or None where its attention
                     keeps score matrices (runtime/train/memory.py, --checkpointing auto)
"""
from __future__ import annotations

import functools
import importlib
import pkgutil

REQUIRED = ("MODEL_TYPES", "HF_ARCHITECTURES", "TARGETS", "spec_from_hf", "declare_weights", "Ctx", "embed",
            "layer_forward", "layer_backward", "lora_tensor_names", "describe", "EMBEDDINGS", "lora_name",
            "weight_name", "required_tensors", "PEFT_LEFT_OUT", "GGUF_ARCHS", "config_from_gguf", "GGUF_LAYER_NAMES",
            "GGUF_GLOBAL_NAMES", "tensor_from_gguf", "GGUF_TARGETS", "gguf_export", "train_extra",
            "CONTEXT_LIMITED", "PACKING_ISOLATED", "RESIDUAL_IN_FP32", "activation_bytes")


@functools.cache
def families() -> tuple:
    """Every family module of this package, by module name."""
    mods = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        mod = importlib.import_module(f"{__name__}.{info.name}")
        missing = [n for n in REQUIRED if not hasattr(mod, n)]
        if missing:
            raise ImportError(f"model family {mod.__name__} lacks {', '.join(missing)}")
        mods.append(mod)
    return tuple(mods)


@functools.cache
def _by_model_type() -> dict:
    out = {}
    for fam in families():
        for t in fam.MODEL_TYPES:
            if t in out:
                raise ImportError(f"model_type {t!r} claimed by {out[t].__name__} and {fam.__name__}")
            out[t] = fam
    return out


def model_types() -> tuple[str, ...]:
    return tuple(_by_model_type())


def for_model_type(model_type):
    """The family module of an HF model_type, or a ValueError listing those lorac trains."""
    fam = _by_model_type().get(model_type) if isinstance(model_type, str) else None
    if fam is None:
        raise ValueError(f"unsupported architecture model_type={model_type!r}; lorac supports "
                         f"{', '.join(model_types())}")
    return fam


def for_spec(spec):
    return for_model_type(spec.arch)


def for_config(config: dict):
    """The family of an HF config dict: by model_type, else by its `architectures` entry."""
    if config.get("model_type") in model_types():
        return for_model_type(config["model_type"])
    arch = (config.get("architectures") or ["?"])[0]
    for fam in families():
        if arch in fam.HF_ARCHITECTURES.values():
            return fam
    return for_model_type(config.get("model_type"))


def spec_from_hf_config(cfg: dict):
    """The spec of a parsed HF config.json, built by its family."""
    return for_model_type(cfg.get("model_type")).spec_from_hf(cfg)


def gguf_archs() -> dict:
    """{general.architecture: family} of every GGUF architecture lorac loads."""
    return {a: fam for fam in families() for a in fam.GGUF_ARCHS}


def hf_architectures() -> dict:
    """{"XForCausalLM": family}."""
    return {a: fam for fam in families() for a in fam.HF_ARCHITECTURES.values()}


@functools.cache
def _by_target() -> dict:
    """{target: family}: a target two families share must have the same names in both."""
    out = {}
    for fam in families():
        for t in fam.TARGETS:
            if t in out and (out[t].lora_name(0, t, "A"), out[t].weight_name(0, t)) != \
                    (fam.lora_name(0, t, "A"), fam.weight_name(0, t)):
                raise ImportError(f"LoRA target {t} is named differently by {out[t].__name__} and {fam.__name__}")
            out.setdefault(t, fam)
    return out


def all_targets() -> tuple[str, ...]:
    return tuple(_by_target())


def for_target(target: str):
    """A family that has LoRA target `target` (all of them name it alike), or a ValueError."""
    fam = _by_target().get(target)
    if fam is None:
        raise ValueError(f"unknown LoRA target {target!r}")
    return fam


def peft_left_out() -> dict:
    """{target: why} of every target a PEFT adapter cannot carry, over all families."""
    return {t: why for fam in families() for t, why in fam.PEFT_LEFT_OUT.items()}


class GgufMeta:
    """GGUF metadata keys of one architecture (`{arch}.{key}`) read as HF config values;
    a missing or malformed value is a ValueError naming the key."""

    def __init__(self, meta: dict, arch: str, vocab_len: int | None = None):
        self.meta, self.arch, self.vocab_len = meta, arch, vocab_len

    def get(self, key: str, default=None):
        return self.meta.get(f"{self.arch}.{key}", default)

    def count(self, key: str, default=None) -> int:
        """A positive integer (GGUF stores counts as unsigned ints)."""
        v = self.get(key, default)
        if v is None:
            raise ValueError(f"GGUF metadata key {self.arch}.{key} is missing")
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"GGUF metadata {self.arch}.{key}={v!r} must be a positive integer")
        return v

    def number(self, key: str, default=None) -> float | None:
        import math
        v = self.get(key, default)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"GGUF metadata {self.arch}.{key}={v!r} must be a finite number")
        return float(v)

    def vocab(self) -> int:
        n = self.get("vocab_size")
        if n is None:  # older files: the vocabulary's length is the vocab size
            n = self.vocab_len
        if n is None:
            raise ValueError("GGUF file states no vocabulary size and has no vocabulary")
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"GGUF vocabulary size {n!r} must be a positive integer")
        return n

    def token_ids(self) -> dict:
        """bos/eos/pad token ids as config.json keys."""
        out = {}
        for key, field in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                           ("pad_token_id", "padding_token_id")):
            if f"tokenizer.ggml.{field}" in self.meta:
                out[key] = int(self.meta[f"tokenizer.ggml.{field}"])
        return out


def no_gguf_export(name: str):
    """gguf_export for a family llama.cpp cannot run adapters of."""
    def gguf_export(config: dict):
        raise ValueError(f"GGUF adapter export is not supported for {name} models; use --format merged or peft")
    return gguf_export


def no_train_extra(name: str):
    """train_extra for a family without options of its own."""
    def train_extra(target: str, scan_chunk: int) -> dict:
        if scan_chunk:
            raise ValueError(f"--scan-chunk is for Mamba models; {name} has no scan")
        return {}
    return train_extra
