"""--adapter PATH: start training from an existing PEFT LoRA adapter (trained anywhere).

The adapter's own tensors decide what is trained: its rank, its targets and its layers
replace --rank, --targets and --trained-layers, its `lora_alpha` and `use_rslora` replace
--alpha and --rslora; its A and B become the starting LoRA weights (the optimizer moments
start at zero). Refused with one line: what lorac cannot continue exactly (DoRA, per-module
ranks or alphas, trained biases or extra modules, pickled .bin weights) and an adapter that
does not fit the model (targets it lacks, layers past its depth, other shapes).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import LoracError


@dataclass
class StartAdapter:
    path: str
    rank: int
    alpha: float
    rslora: bool
    targets: tuple[str, ...]
    layers: tuple[int, ...]
    lora: dict  # lorac (= PEFT) tensor name -> float32 array
    base: str  # the adapter's base_model_name_or_path

    def describe(self) -> str:
        return (f"{self.path}: r={self.rank} alpha={self.alpha:g}{' rslora' if self.rslora else ''} "
                f"targets={','.join(self.targets)} layers={self.layers[0]}..{self.layers[-1]}"
                + (f" (trained on {self.base})" if self.base else ""))

    def trained_layers(self, n_layers: int) -> str | None:
        """The layers as TrainConfig.trained_layers: None for all of them, else "i,j,..."."""
        return None if self.layers == tuple(range(n_layers)) else ",".join(map(str, self.layers))

    def check_shapes(self, shapes: dict) -> None:
        """The model's LoRA shapes (Engine.shapes) against the adapter's tensors."""
        for name, shape in shapes.items():
            got = self.lora[name].shape
            if tuple(got) != tuple(shape):
                raise LoracError(f"{self.path}: {name} has shape {list(got)}, this model needs {list(shape)} "
                                 "(an adapter of another base model?)")


def _config(folder: Path) -> dict:
    from ..files import open_regular
    try:
        with open_regular(folder / "adapter_config.json", what="adapter_config.json") as f:
            config = json.load(f)
    except FileNotFoundError:
        raise LoracError(f"{folder}: not a PEFT adapter directory (no adapter_config.json)") from None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise LoracError(f"{folder}/adapter_config.json: not valid JSON ({'nested too deeply' if isinstance(e, RecursionError) else e})") from None
    if not isinstance(config, dict):
        raise LoracError(f"{folder}/adapter_config.json: a JSON object is expected")
    refusals = [(config.get("peft_type", "LORA") != "LORA", f"peft_type {config.get('peft_type')} (only LORA)"),
                (bool(config.get("use_dora")), "DoRA (use_dora)"),
                (bool(config.get("rank_pattern")) or bool(config.get("alpha_pattern")), "per-module ranks or alphas"),
                (config.get("bias", "none") != "none", f"trained biases (bias={config.get('bias')})"),
                (bool(config.get("modules_to_save")), "fully trained extra modules (modules_to_save)")]
    for refused, what in refusals:
        if refused:
            raise LoracError(f"{folder}: the adapter uses {what}, which lorac cannot continue training")
    return config


def _tensors(folder: Path) -> dict:
    from safetensors import SafetensorError
    from safetensors.numpy import load_file
    path = folder / "adapter_model.safetensors"
    if not path.exists():
        why = " (adapter_model.bin is a pickle, which lorac does not load)" if (folder / "adapter_model.bin").exists() else ""
        raise LoracError(f"{folder}: no adapter_model.safetensors{why}")
    from ..files import check_regular
    check_regular(path, "safetensors file")
    try:
        raw = load_file(str(path))
    except SafetensorError as e:
        raise LoracError(f"{path}: corrupt safetensors file ({(str(e).splitlines() or [''])[0]})") from None
    # in-memory PEFT names carry the adapter's name (".lora_A.default.weight"); saved ones do not
    return {k.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B."): v.astype(np.float32)
            for k, v in raw.items()}


def read_adapter(path, spec) -> StartAdapter:
    """The PEFT adapter in directory `path` for a model of ModelSpec `spec`, or a LoracError."""
    from ..export import lora_name, lora_pairs
    folder = Path(path)
    if not folder.is_dir():
        raise LoracError(f"adapter not found: {path} (a PEFT adapter directory is expected)")
    config = _config(folder)
    try:
        pairs = lora_pairs(_tensors(folder))
    except LoracError as e:
        raise LoracError(f"{folder}: {e}") from None
    targets = {t for _, t in pairs}
    layers = tuple(sorted({i for i, _ in pairs}))
    foreign = sorted(targets - set(spec.targets))
    if foreign:
        raise LoracError(f"{folder}: the adapter has LoRA on {', '.join(foreign)}, which a {spec.arch} model does not "
                         f"have (its targets: {', '.join(spec.targets)})")
    if layers[-1] >= spec.layers:
        raise LoracError(f"{folder}: the adapter has LoRA on layer {layers[-1]}, the model has {spec.layers} layers")
    hole = next(((i, t) for i in layers for t in targets if (i, t) not in pairs), None)
    if hole:
        raise LoracError(f"{folder}: the adapter has no LoRA on layer {hole[0]} {hole[1]}; lorac trains every target "
                         "in every adapted layer")
    lora = {lora_name(i, t, ab): x for (i, t), (a, b) in pairs.items() for ab, x in (("A", a), ("B", b))}
    return StartAdapter(path=str(folder), rank=int(next(iter(pairs.values()))[0].shape[0]),
                        alpha=float(config.get("lora_alpha", 8)), rslora=bool(config.get("use_rslora", False)),
                        targets=tuple(t for t in spec.targets if t in targets), layers=layers, lora=lora,
                        base=str(config.get("base_model_name_or_path") or ""))
