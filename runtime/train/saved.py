"""SavedRun: a checkpoint's run as its state.json records it (train/checkpoint.py writes the
file, train/run.py what goes in it), read in one place and typed.

`lorac eval`, `generate` and `export` take their defaults from it, `--resume` checks a run
against it and adopts its activation-checkpointing and embedding-quantization choices. A setting a state.json lacks is
None (checkpoints from before the setting existed), and readers fall back on their own
defaults. Older spellings keep loading: `targets` (before the field became `lora_targets`)
and `checkpointing` as true/false (before it took auto/on/off).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from pathlib import Path


@dataclass(frozen=True)
class SavedRun:
    path: Path | None = None  # the checkpoint directory (None: no checkpoint, the base model)
    step: int = 0
    model: str | None = None  # --model as given (None: the bundled default)
    batch: int | None = None
    seq: int | None = None
    rank: int | None = None
    alpha: float | None = None
    rslora: bool = False
    lora_targets: tuple[str, ...] | None = None
    trained_layers: str | None = None
    packing: str | None = None  # as resolved (checkpoints record what ran)
    truncate: str | None = None  # --truncate (none before it existed: "none")
    checkpointing: str = "off"  # "on", "off" or "offload" as resolved
    keep_layers: int = 0
    keep_mlp: int = 0  # recomputed layers that keep their MLP half (TrainSpec.keep_mlp), as resolved
    offload_state: str | None = None  # --offload-state as resolved ("off" where auto's state did not fit)
    quantize_embeddings: str | None = None  # "off", "nf4" or "int8" as resolved (None: before the setting)
    loss_chunk: int = 0  # --loss-chunk as given or as --checkpointing auto chose it (0: the device's default)
    steps: int | None = None
    optimizer: dict = field(default_factory=dict)  # the optimizer settings it recorded (TrainConfig.optimizer_settings)
    schedule_steps: int | None = None  # the steps the learning-rate schedule decays over
    data_sha256: str | None = None  # the training token stream's digest (data.PackedData.digest)
    model_config: dict = field(default_factory=dict)  # the model's HF config dict

    @classmethod
    def from_state(cls, state: dict, path=None) -> SavedRun:
        """The SavedRun of a verified state.json dict (train/checkpoint.read_state)."""
        from ..config import TrainConfig
        tc = state.get("train_config") or {}
        targets = tc.get("lora_targets") or tc.get("targets")  # `targets` before the rename
        ckpt = tc.get("checkpointing", False)
        ckpt = ("on" if ckpt else "off") if isinstance(ckpt, bool) else (ckpt if ckpt in ("on", "offload") else "off")
        return cls(path=Path(path) if path is not None else None, step=state.get("step", 0), model=tc.get("model"),
                   batch=tc.get("batch"), seq=tc.get("seq"), rank=tc.get("rank"), alpha=tc.get("alpha"),
                   rslora=bool(tc.get("rslora", False)), lora_targets=tuple(targets) if targets else None,
                   trained_layers=tc.get("trained_layers"), packing=tc.get("packing"), truncate=tc.get("truncate"),
                   checkpointing=ckpt,
                   keep_layers=int(tc.get("keep_layers") or 0), keep_mlp=int(tc.get("keep_mlp") or 0),
                   offload_state=tc.get("offload_state"),
                   quantize_embeddings=tc.get("quantize_embeddings"), loss_chunk=int(tc.get("loss_chunk") or 0),
                   steps=tc.get("steps"),
                   optimizer={k: tc[k] for k in TrainConfig.optimizer_settings() if tc.get(k) is not None},
                   schedule_steps=state.get("schedule_steps"), data_sha256=state.get("data_sha256"),
                   model_config=state.get("model_config") or {})

    @classmethod
    def read(cls, path) -> SavedRun:
        """The SavedRun of checkpoint `path` (a directory or a root with `latest`), its
        state.json verified, no tensor read."""
        from . import checkpoint
        d = checkpoint.resolve(path)
        return cls.from_state(checkpoint.read_state(d), d)

    @classmethod
    def of(cls, ck) -> SavedRun:
        """The SavedRun of a loaded Checkpoint."""
        return cls.from_state(ck.state, ck.path)

    def config(self, defaults, **given):
        """A TrainConfig: `defaults` (a TrainConfig), then the settings this run recorded,
        then the `given` ones that are not None (flags of the command at hand)."""
        from ..config import TrainConfig
        names = {f.name for f in fields(TrainConfig)}
        saved = {f.name: getattr(self, f.name) for f in fields(self) if f.name in names}
        saved = {k: v for k, v in saved.items() if v is not None}
        saved.update({k: v for k, v in self.optimizer.items() if k in names})
        saved.update({k: v for k, v in given.items() if v is not None})
        return replace(defaults, **saved)
