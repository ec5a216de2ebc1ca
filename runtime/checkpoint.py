"""Checkpoints: LoRA tensors, optimizer state and everything needed to resume exactly.

Layout of a run's checkpoint root (usually OUT/checkpoints):
    ckpt-000100/lora.safetensors    LoRA tensors by PEFT name (float32)
    ckpt-000100/optim.safetensors   "<name>.m" and "<name>.v" (float32)
    ckpt-000100/state.json          step, RNG state, data position, configs, hashes, versions,
                                    and the sha256 of both safetensors files
    latest                          one line: the directory name of the newest checkpoint

Crash safety (kill -9 at any instant leaves the previous checkpoint loadable): a checkpoint
is written into a hidden temp directory, every file fsync'ed, the directory fsync'ed, then
renamed to a name never used before (rename of a directory is atomic on POSIX); only then is
`latest` replaced, itself through a temp file + fsync + os.replace. A reader follows
`latest`, so it sees either the old or the new checkpoint, never a half-written one. Old
checkpoints beyond `keep` are deleted after `latest` moved. No pickle: JSON and safetensors.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

from .errors import LoracError

FORMAT = "lorac-checkpoint-1"
LATEST = "latest"


@dataclass
class Checkpoint:
    path: Path
    step: int
    lora: dict[str, np.ndarray]
    m: dict[str, np.ndarray]
    v: dict[str, np.ndarray]
    state: dict = field(default_factory=dict)  # the whole state.json


def config_hash(config: dict) -> str:
    """sha256 of a JSON-able dict in canonical form (sorted keys, no spaces)."""
    blob = json.dumps(config, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(blob).hexdigest()


def rng_state(rng: np.random.Generator) -> dict:
    """A numpy Generator's state as plain JSON (bit_generator.state is dicts of ints/strs)."""
    return rng.bit_generator.state


def rng_from_state(state: dict) -> np.random.Generator:
    bitgen = getattr(np.random, state["bit_generator"])()
    bitgen.state = state
    return np.random.Generator(bitgen)


# -- writing -----------------------------------------------------------------------------
def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    # a directory fsync makes the names inside it (new files, renames) durable; Windows cannot
    # open a directory as a file, and NTFS commits renames with its metadata journal
    if os.name == "nt":
        return
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _f32(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in tensors.items()}


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)  # atomic: readers see the old or the new content
    _fsync_dir(path.parent)


def save_checkpoint(root, step: int, lora: dict[str, np.ndarray], m: dict[str, np.ndarray],
                    v: dict[str, np.ndarray], state: dict | None = None, keep: int = 3, *,
                    model_hash: str | None = None, graph_hash: str | None = None) -> Path:
    """Write checkpoint `step` under `root` atomically, point `latest` at it, prune to `keep`.

    `state` holds what the loop needs to resume (JSON-able), stored at the top level of
    state.json: e.g. {"rng": rng_state(rng), "data": {...iterator position...},
    "train_config": {...}}. `model_hash` (config_hash of the model config) and `graph_hash`
    (the artifact's) are what load_checkpoint checks. Returns the checkpoint directory.
    """
    from lorac import __version__
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    if set(m) != set(lora) or set(v) != set(lora):
        raise LoracError("save_checkpoint: optimizer state names differ from the LoRA tensor names")
    name = f"ckpt-{step:06d}"
    n = 1
    while (root / name).exists():  # a re-save of the same step gets a fresh name: never overwrite
        name = f"ckpt-{step:06d}.{n}"
        n += 1
    tmp = root / f".tmp-{name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    save_file(_f32(lora), str(tmp / "lora.safetensors"))
    optim = {f"{k}.m": x for k, x in _f32(m).items()} | {f"{k}.v": x for k, x in _f32(v).items()}
    save_file(optim, str(tmp / "optim.safetensors"))
    meta = {"format": FORMAT, "lorac_version": __version__, "step": int(step), **(state or {}),
            **({"model_hash": model_hash} if model_hash is not None else {}),
            **({"graph_hash": graph_hash} if graph_hash is not None else {}),
            "files": {f: _sha256(tmp / f) for f in ("lora.safetensors", "optim.safetensors")}}
    (tmp / "state.json").write_text(json.dumps(meta, indent=1, sort_keys=True))
    for f in ("lora.safetensors", "optim.safetensors", "state.json"):
        _fsync_file(tmp / f)
    _fsync_dir(tmp)
    os.rename(tmp, root / name)  # the checkpoint appears whole or not at all
    _fsync_dir(root)
    _write_text_atomic(root / LATEST, name + "\n")
    _prune(root, keep, current=name)
    return root / name


def _prune(root: Path, keep: int, current: str) -> None:
    if keep <= 0:
        return
    dirs = sorted((d for d in root.iterdir() if d.is_dir() and d.name.startswith("ckpt-")),
                  key=lambda d: d.stat().st_mtime)
    for d in dirs[:-keep]:
        if d.name != current:
            shutil.rmtree(d, ignore_errors=True)
    for d in root.iterdir():  # temp dirs of writers that were killed
        if d.name.startswith(".tmp-ckpt-") and not d.name.endswith(f"-{os.getpid()}"):
            shutil.rmtree(d, ignore_errors=True)


# -- reading -----------------------------------------------------------------------------
def resolve(path) -> Path:
    """A checkpoint directory from either itself or a root holding `latest`."""
    path = Path(path)
    if not path.exists():
        raise LoracError(f"checkpoint not found: {path}")
    if (path / "state.json").exists():
        return path
    if (path / LATEST).exists():
        name = (path / LATEST).read_text().strip()
        if not name or "/" in name or not (path / name / "state.json").exists():
            raise LoracError(f"checkpoint pointer {path / LATEST} names {name!r}, which is not a checkpoint")
        return path / name
    raise LoracError(f"not a lorac checkpoint (no state.json or {LATEST}): {path}")


def load_checkpoint(path, model_hash: str | None = None, graph_hash: str | None = None) -> Checkpoint:
    """Read and verify a checkpoint (directory or root with `latest`).

    Raises LoracError with one line for a missing, corrupt, foreign-format checkpoint or, when
    `model_hash`/`graph_hash` are given, one made for another model or artifact.
    """
    d = resolve(path)
    try:
        state = json.loads((d / "state.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoracError(f"corrupt checkpoint {d}: state.json unreadable ({type(e).__name__})") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise LoracError(f"not a lorac checkpoint ({d / 'state.json'} has format "
                         f"{state.get('format') if isinstance(state, dict) else None!r}, expected {FORMAT!r})")
    for f, digest in state.get("files", {}).items():
        if not (d / f).exists():
            raise LoracError(f"corrupt checkpoint {d}: {f} is missing")
        if _sha256(d / f) != digest:
            raise LoracError(f"corrupt checkpoint {d}: {f} does not match its recorded sha256")
    if model_hash is not None and state.get("model_hash") != model_hash:
        raise LoracError(f"checkpoint {d} was made for another model (model hash "
                         f"{str(state.get('model_hash'))[:12]} != {model_hash[:12]})")
    if graph_hash is not None and state.get("graph_hash") != graph_hash:
        raise LoracError(f"checkpoint {d} was made with another training graph (graph hash "
                         f"{str(state.get('graph_hash'))[:12]} != {graph_hash[:12]})")
    try:
        lora = load_file(str(d / "lora.safetensors"))
        optim = load_file(str(d / "optim.safetensors"))
    except (OSError, SafetensorError) as e:
        raise LoracError(f"corrupt checkpoint {d}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    m = {k: optim.get(f"{k}.m") for k in lora}
    v = {k: optim.get(f"{k}.v") for k in lora}
    missing = [k for k in lora if m[k] is None or v[k] is None]
    if missing:
        raise LoracError(f"corrupt checkpoint {d}: no optimizer state for {missing[0]}")
    return Checkpoint(d, int(state["step"]), lora, m, v, state)
