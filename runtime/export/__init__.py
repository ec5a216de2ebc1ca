"""Adapter export: PEFT adapter directory, merged HF model, GGUF LoRA adapter (llama.cpp).

LoRA tensors arrive as float32 numpy arrays under their PEFT names,
    base_model.model.model.layers.{i}.{self_attn|mlp}.{target}.lora_A.weight  [r, in]
    base_model.model.model.layers.{i}.{self_attn|mlp}.{target}.lora_B.weight  [out, r]
or, for Mamba-1, base_model.model.backbone.layers.{i}.mixer.{target}.lora_{A|B}.weight
(each model family names its own: graphs/families/), and W_eff = W + s * B @ A with s = alpha / r (alpha / sqrt(r) with rsLoRA). The formats
are described in docs/EXPORT.md (Mamba: docs/MAMBA.md).
"""
from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import ml_dtypes  # noqa: F401  (registers numpy's 'bfloat16' so safetensors can read/write bf16)
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from lorac.graphs import families

from ..errors import LoracError
from .output import staged
from ..model.weights import as_dtype, read_index

_NAME = re.compile(r"^base_model\.model\..+\.layers\.(\d+)\.[\w.]+?\.(\w+)\.lora_(A|B)\.weight$")
# from the model families (graphs/families/): the targets a PEFT adapter cannot carry, and why
PEFT_LEFT_OUT = families.peft_left_out()
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "generation_config.json")
# what each export writes: an existing --out holding only these is a previous export, replaced whole
PEFT_FILES = ("adapter_config.json", "adapter_model.safetensors")
MERGED_FILES = ("config.json", "*.safetensors", "model.safetensors.index.json") + TOKENIZER_FILES


# -- names and pairs -----------------------------------------------------------------------
def lora_scale(alpha: float, r: int, use_rslora: bool = False) -> float:
    """s in W + s*B@A: alpha/r, or alpha/sqrt(r) with rsLoRA (PEFT's LoraLayer.update_layer)."""
    return alpha / math.sqrt(r) if use_rslora else alpha / r


def lora_pairs(lora: dict[str, np.ndarray]) -> dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]:
    """{(layer, target): (A, B)}, checking names, shapes and that every A has its B."""
    parts: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for name, t in lora.items():
        mt = _NAME.match(name)
        if not mt or mt.group(2) not in families.all_targets() or lora_name(int(mt.group(1)), mt.group(2), mt.group(3)) != name:
            raise LoracError(f"not a LoRA tensor name lorac exports: {name}")
        parts.setdefault((int(mt.group(1)), mt.group(2)), {})[mt.group(3)] = np.asarray(t)
    out = {}
    for key, ab in sorted(parts.items()):
        if set(ab) != {"A", "B"}:
            raise LoracError(f"LoRA layer {key[0]} {key[1]} has lora_{''.join(ab)} but not its partner")
        a, b = ab["A"], ab["B"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise LoracError(f"LoRA layer {key[0]} {key[1]}: shapes A{a.shape} B{b.shape} do not chain (A [r,in], B [out,r])")
        for ab_name, t in (("A", a), ("B", b)):
            if t.dtype.kind != "f" or not np.isfinite(t).all():
                raise LoracError(f"LoRA layer {key[0]} {key[1]}: lora_{ab_name} holds NaN or infinite values; "
                                 "nothing exported (the checkpoint is damaged or training diverged)")
        out[key] = (a, b)
    if not out:
        raise LoracError("no LoRA tensors to export")
    ranks = {a.shape[0] for a, _ in out.values()}
    if len(ranks) != 1:
        raise LoracError(f"LoRA tensors have mixed ranks {sorted(ranks)}; export needs one rank")
    return out


def lora_name(layer: int, target: str, ab: str) -> str:
    """PEFT's key of a LoRA tensor, as the target's model family names it."""
    return families.for_target(target).lora_name(layer, target, ab)


def weight_name(layer: int, target: str) -> str:
    """HF's name of the adapted weight, as the target's model family names it."""
    return families.for_target(target).weight_name(layer, target)


# -- (a) PEFT adapter ----------------------------------------------------------------------
class PeftRefused(LoracError):
    """Every LoRA target of the adapter is one PEFT refuses on this model family."""


def export_peft(out_dir, lora: dict[str, np.ndarray], *, alpha: float, use_rslora: bool = False,
                base_model_name_or_path: str = "", num_hidden_layers: int | None = None, warn=None,
                legacy: bool = False) -> Path:
    """Write adapter_config.json + adapter_model.safetensors that PeftModel.from_pretrained loads.

    `num_hidden_layers` (the base model's) lets the config say `layers_to_transform` when
    only some layers carry LoRA; without it every layer is assumed adapted. `legacy`: an
    existing `out_dir` without lorac's marker may be replaced (output.check_replaceable). Mamba targets in
    PEFT_LEFT_OUT (a family's, e.g. Mamba's dt_proj) are dropped with one line to `warn`;
    nothing left: PeftRefused.
    """
    pairs = lora_pairs(lora)
    dropped = sorted({t for (_, t) in pairs if t in PEFT_LEFT_OUT})
    if dropped:
        pairs = {k: ab for k, ab in pairs.items() if k[1] not in dropped}
        why = "; ".join(f"{t}: {PEFT_LEFT_OUT[t]}" for t in dropped)
        if not pairs:
            raise PeftRefused(f"no PEFT adapter for LoRA on {', '.join(dropped)} ({why}); "
                              "export it with --format merged")
        if warn:
            warn(f"warning: the PEFT adapter leaves out the LoRA on {', '.join(dropped)} ({why}), so it differs "
                 "from the trained model; --format merged carries every target")
    r = next(iter(pairs.values()))[0].shape[0]
    layers = sorted({layer for layer, _ in pairs})
    targets = sorted({t for _, t in pairs})
    missing = [(i, t) for i in layers for t in targets if (i, t) not in pairs]
    if missing:  # PEFT applies every target to every chosen layer; a hole would load as B=0 silently
        raise LoracError(f"LoRA set has no tensors for layer {missing[0][0]} {missing[0][1]}: PEFT needs every "
                         "target in every adapted layer")
    partial = num_hidden_layers is not None and layers != list(range(num_hidden_layers))
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model_name_or_path,
        "r": int(r), "lora_alpha": alpha, "use_rslora": bool(use_rslora), "target_modules": targets,
        "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
        "init_lora_weights": True, "use_dora": False, "modules_to_save": None,
        "layers_to_transform": layers if partial else None, "layers_pattern": None,
        "rank_pattern": {}, "alpha_pattern": {}, "revision": None,
    }
    tensors = {}
    for (layer, t), (a, b) in pairs.items():  # PEFT's saved keys drop the adapter name ("default")
        tensors[lora_name(layer, t, "A")] = np.ascontiguousarray(a, dtype=np.float32)
        tensors[lora_name(layer, t, "B")] = np.ascontiguousarray(b, dtype=np.float32)
    with staged(out_dir, "dir", PEFT_FILES, "peft", legacy) as out:
        (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    return Path(out_dir)


# -- (b) merged model ----------------------------------------------------------------------
def merge_lora(weights: dict[str, np.ndarray], lora: dict[str, np.ndarray], *, alpha: float,
               use_rslora: bool = False) -> dict[str, np.ndarray]:
    """A copy of `weights` (HF names) with W + s*B@A folded into each adapted matrix.

    The product is formed in float32 and added to W in float32, then cast back to W's dtype
    (bf16/fp16 sources lose only the final rounding). Unadapted tensors are shared, not copied.
    """
    pairs = lora_pairs(lora)
    s = lora_scale(alpha, next(iter(pairs.values()))[0].shape[0], use_rslora)
    out = dict(weights)
    for (layer, t), (a, b) in pairs.items():
        key = weight_name(layer, t)
        if key not in weights:
            raise LoracError(f"base model has no weight {key} for the LoRA on layer {layer} {t}")
        w = weights[key]
        if w.shape != (b.shape[0], a.shape[1]):
            raise LoracError(f"{key} has shape {tuple(w.shape)}, the LoRA expects {(b.shape[0], a.shape[1])}")
        delta = s * (b.astype(np.float32) @ a.astype(np.float32))
        out[key] = (w.astype(np.float32) + delta).astype(w.dtype)
    return out


def _model_files(model_dir: Path) -> list[str]:
    """The base model's weight files, relative to it (shards checked to lie inside: weights.read_index)."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        return sorted(set(read_index(model_dir).values()))
    if (model_dir / "model.safetensors").exists():
        return ["model.safetensors"]
    raise LoracError(f"no model.safetensors (or model.safetensors.index.json) in {model_dir}")


def export_merged(out_dir, model_dir, lora: dict[str, np.ndarray], *, alpha: float, use_rslora: bool = False,
                  dtype: str | None = None) -> Path:
    """An HF model directory with the LoRA folded in, shard layout kept as in `model_dir`.

    `dtype`: None keeps each tensor's source dtype; "float32", "bfloat16" or "float16" writes every
    float tensor so (and says so in config.json). config.json, the index and tokenizer files are copied.
    """
    model_dir, out = Path(model_dir), Path(out_dir)
    if not (model_dir / "config.json").exists():
        raise LoracError(f"no config.json in {model_dir}")
    if dtype not in (None, "float32", "bfloat16", "float16"):
        raise LoracError(f"merged export dtype must be float32, bfloat16 or float16 (or none: the source's), got {dtype!r}")
    pairs = lora_pairs(lora)
    with staged(out, "dir", MERGED_FILES, "merged") as tmp:
        _write_merged(tmp, model_dir, pairs, alpha, use_rslora, dtype)
    return out


def _write_merged(out: Path, model_dir: Path, pairs: dict, alpha: float, use_rslora: bool, dtype) -> None:
    done = set()
    for fname in _model_files(model_dir):
        try:
            with safe_open(str(model_dir / fname), framework="numpy") as f:
                weights = {k: f.get_tensor(k) for k in f.keys()}
        except (OSError, SafetensorError) as e:
            raise LoracError(f"cannot read {model_dir / fname}: {str(e).splitlines()[0]}") from None
        mine = {lora_name(i, t, ab): x for (i, t), (a, b) in pairs.items() if weight_name(i, t) in weights
                for ab, x in (("A", a), ("B", b))}
        merged = merge_lora(weights, mine, alpha=alpha, use_rslora=use_rslora) if mine else weights
        done |= {k for k in mine}
        if dtype:
            merged = {k: v.astype(as_dtype(dtype)) if v.dtype.kind == "f" or v.dtype.name == "bfloat16" else v
                      for k, v in merged.items()}
        (out / fname).parent.mkdir(parents=True, exist_ok=True)  # inside the staging folder (read_index)
        save_file({k: np.ascontiguousarray(v) for k, v in merged.items()}, str(out / fname), metadata={"format": "pt"})
    if len(done) != 2 * len(pairs):
        left = sorted(set(lora_name(i, t, "A") for i, t in pairs) - done)
        raise LoracError(f"base model has no weight for LoRA tensor {left[0]}")
    config = json.loads((model_dir / "config.json").read_text())
    if dtype:
        for key in ("torch_dtype", "dtype"):
            if key in config:
                config[key] = dtype
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for extra in ("model.safetensors.index.json",) + TOKENIZER_FILES:
        if (model_dir / extra).exists():
            shutil.copyfile(model_dir / extra, out / extra)


def export_merged_weights(out_dir, weights: dict[str, np.ndarray], config: dict, lora: dict[str, np.ndarray], *,
                          alpha: float, use_rslora: bool = False, tokenizer_dir=None, tokenizer=None,
                          dtype: str | None = None) -> Path:
    """A merged HF directory from weights already in memory (HF names), e.g. a GGUF base.

    Writes config.json and one model.safetensors, in `dtype` ("bfloat16", "float16",
    "float32"; None: as the tensors are); copies the tokenizer files found in `tokenizer_dir`,
    or writes them from a lorac `tokenizer` (runtime/export/tokenizer.py). A tied lm_head is left
    out, as transformers' save_pretrained does.
    """
    merged = merge_lora(weights, lora, alpha=alpha, use_rslora=use_rslora)
    if config.get("tie_word_embeddings") and "lm_head.weight" in merged:
        merged = {k: x for k, x in merged.items() if k != "lm_head.weight"}
    if dtype:
        merged = {k: x.astype(as_dtype(dtype)) for k, x in merged.items()}
        config = {**config, "torch_dtype": dtype, "dtype": dtype}
    with staged(out_dir, "dir", MERGED_FILES, "merged") as out:
        save_file({k: np.ascontiguousarray(x) for k, x in merged.items()}, str(out / "model.safetensors"),
                  metadata={"format": "pt"})
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if tokenizer_dir is not None:
            for extra in TOKENIZER_FILES:
                if (Path(tokenizer_dir) / extra).exists():
                    shutil.copyfile(Path(tokenizer_dir) / extra, out / extra)
        elif tokenizer is not None:
            from .tokenizer import write_tokenizer_files
            write_tokenizer_files(out, tokenizer, config)
    return Path(out_dir)


# -- (c) GGUF LoRA adapter (llama.cpp) -------------------------------------------------------
def llama_qk_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Reorder rows per head from HF's RoPE layout (first half / second half of each head's
    dims are the pairs) to GGML's (pairs adjacent): new row 2i+j <- old row j*(d/2)+i.

    This is what convert_hf_to_gguf.py does to llama q_proj/k_proj weights; for W + s*B@A
    only B's rows move (permuting the rows of B@A is permuting the rows of B).
    """
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise LoracError(f"cannot split {rows} rows into {n_head} heads of pairs")
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def export_gguf(out_path, lora: dict[str, np.ndarray], *, alpha: float, model_config: dict,
                use_rslora: bool = False, name: str = "lorac adapter") -> Path:
    """Write a llama.cpp LoRA adapter (`llama-cli -m base.gguf --lora this.gguf`).

    llama.cpp scales by alpha / r (r read from lora_b), so rsLoRA's alpha/sqrt(r) is written
    as alpha_eff = alpha * sqrt(r). Tensors are float32.
    """
    import gguf  # the gguf package (a lorac dependency); imported here to keep startup light

    try:
        family = families.for_config(model_config)
        arch, permute = family.gguf_export(model_config)  # llama.cpp's architecture, {target: heads} to permute
    except ValueError as e:
        name = (model_config.get("architectures") or [model_config.get("model_type")])[0]
        if "unsupported architecture" in str(e):
            raise LoracError(f"GGUF export supports {', '.join(families.hf_architectures())}; the model is {name}") from None
        raise LoracError(str(e)) from None
    if not alpha > 0:  # llama.cpp reads alpha == 0 as "no scaling" (scale 1), not as s = 0
        raise LoracError(f"GGUF export needs lora alpha > 0, got {alpha}")
    pairs = lora_pairs(lora)
    r = next(iter(pairs.values()))[0].shape[0]
    alpha_eff = alpha * math.sqrt(r) if use_rslora else alpha
    with staged(out_path, "file", fmt="gguf") as tmp:
        _write_gguf(gguf, tmp, arch, alpha_eff, name, pairs, permute, family.GGUF_TARGETS)
    return Path(out_path)


def _write_gguf(gguf, path: Path, arch: str, alpha_eff: float, name: str, pairs: dict, permute: dict,
                stems: dict) -> None:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_type(gguf.GGUFType.ADAPTER)                       # general.type = "adapter"
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")            # adapter.type = "lora"
    w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(alpha_eff))
    w.add_name(name)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    for (layer, t), (a, b) in pairs.items():
        b = np.asarray(b, dtype=np.float32)
        if t in permute:
            b = llama_qk_permute(b, permute[t])
        if t not in stems:
            raise LoracError(f"GGUF export: {arch} has no tensor for LoRA target {t}")
        base = f"blk.{layer}.{stems[t]}.weight"
        # numpy [r, in] is GGML ne [in, r]: llama.cpp checks a.ne[0] == W.ne[0] (in) and
        # b.ne[1] == W.ne[1] (out), exactly what PEFT's shapes give after the reversal
        w.add_tensor(base + ".lora_a", np.ascontiguousarray(a, dtype=np.float32))
        w.add_tensor(base + ".lora_b", np.ascontiguousarray(b))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
