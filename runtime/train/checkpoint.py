"""Checkpoints: LoRA tensors, optimizer state and everything needed to resume exactly.

Layout of a run's checkpoint root (usually OUT/checkpoints):
    ckpt-000100/lora.safetensors    LoRA tensors by PEFT name (float32)
    ckpt-000100/optim.safetensors   "<name>.m" and "<name>.v" (float32)
    ckpt-000100/state.json          step, RNG state, data position, configs, hashes, versions,
                                    the sha256 of both safetensors files, and `state_sha256`,
                                    the seal over all of state.json (core/integrity.py)
    latest                          one line: the directory name of the newest checkpoint

Crash safety (kill -9 at any instant leaves the previous checkpoint loadable): a checkpoint
is written into a hidden temp directory, every file fsync'ed, the directory fsync'ed, then
renamed to a name never used before (rename of a directory is atomic on POSIX); only then is
`latest` replaced, itself through a temp file + fsync + os.replace. A reader follows
`latest`, so it sees either the old or the new checkpoint, never a half-written one. After
`latest` moved, complete checkpoints beyond the `keep` highest steps are pruned: each is first
renamed to a hidden trash name (atomic), then deleted, so a kill while pruning never leaves a
half-deleted `ckpt-*`. A reader refuses a checkpoint whose seal or tensor checksums fail, or
whose state lacks a field it needs. No pickle: JSON and safetensors.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

from lorac.core import atomic
from lorac.core import integrity
from ..errors import LoracError

FORMAT = "lorac-checkpoint-2"  # 2: state.json sealed (state_sha256)
LATEST = "latest"
SEAL = "state_sha256"
TENSOR_FILES = ("lora.safetensors", "optim.safetensors")
_NAME = re.compile(r"^ckpt-(\d+)(?:\.(\d+))?$")  # ckpt-000100, or ckpt-000100.1 for a re-save
# numpy's bit generators by name: the only names a state.json may ask for
BIT_GENERATORS = ("PCG64", "PCG64DXSM", "Philox", "SFC64", "MT19937")


@dataclass
class Checkpoint:
    path: Path
    step: int
    lora: dict[str, np.ndarray]
    m: dict[str, np.ndarray]
    v: dict[str, np.ndarray]
    state: dict = field(default_factory=dict)  # the whole state.json


config_hash = integrity.sha256_json  # sha256 of a JSON-able dict in canonical form


def rng_state(rng: np.random.Generator) -> dict:
    """A numpy Generator's state as plain JSON (bit_generator.state is dicts of ints/strs)."""
    return rng.bit_generator.state


def rng_from_state(state: dict) -> np.random.Generator:
    name = state.get("bit_generator") if isinstance(state, dict) else None
    if name not in BIT_GENERATORS:
        raise LoracError(f"checkpoint RNG state names bit generator {name!r}; expected one of {', '.join(BIT_GENERATORS)}")
    bitgen = getattr(np.random, name)()
    try:
        bitgen.state = state
    except (TypeError, ValueError, KeyError) as e:
        raise LoracError(f"checkpoint RNG state is not a valid {name} state ({type(e).__name__})") from None
    return np.random.Generator(bitgen)


# -- writing -----------------------------------------------------------------------------
_fsync_file = _fsync_dir = atomic.fsync_path
_sha256 = integrity.sha256_file


def _f32(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in tensors.items()}


def _write_text_atomic(path: Path, text: str) -> None:
    atomic.write_text(path, text, durable=True)  # readers see the old or the new content


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
    try:
        _write_dir(tmp, lora, m, v, {"format": FORMAT, "lorac_version": __version__, "step": int(step), **(state or {}),
                                     **({"model_hash": model_hash} if model_hash is not None else {}),
                                     **({"graph_hash": graph_hash} if graph_hash is not None else {})})
        os.rename(tmp, root / name)  # the checkpoint appears whole or not at all
        _fsync_dir(root)
        _write_text_atomic(root / LATEST, name + "\n")
    except (OSError, SafetensorError) as e:  # disk full, read-only, quota: the previous checkpoint stays
        shutil.rmtree(tmp, ignore_errors=True)
        raise LoracError(f"cannot write checkpoint {root / name}: {_reason(e)}") from None
    _prune(root, keep, current=name)
    return root / name


def _write_dir(tmp: Path, lora: dict, m: dict, v: dict, meta: dict) -> None:
    """The three files of a checkpoint in directory `tmp`, fsynced, state.json sealed."""
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    save_file(_f32(lora), str(tmp / "lora.safetensors"))
    optim = {f"{k}.m": x for k, x in _f32(m).items()} | {f"{k}.v": x for k, x in _f32(v).items()}
    save_file(optim, str(tmp / "optim.safetensors"))
    meta = integrity.seal({**meta, "files": {f: _sha256(tmp / f) for f in TENSOR_FILES}}, SEAL)
    (tmp / "state.json").write_text(json.dumps(meta, indent=1, sort_keys=True))
    for f in TENSOR_FILES + ("state.json",):
        _fsync_file(tmp / f)
    _fsync_dir(tmp)


def _reason(e: Exception) -> str:
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def _complete(d: Path) -> tuple[int, int] | None:
    """(step, re-save number) of a complete checkpoint directory, else None."""
    mt = _NAME.match(d.name)
    if not mt or not d.is_dir() or not all((d / f).is_file() for f in TENSOR_FILES + ("state.json",)):
        return None
    return int(mt.group(1)), int(mt.group(2) or 0)


def _prune(root: Path, keep: int, current: str) -> None:
    """Keep `current` and the `keep` complete checkpoints of highest step; delete the others
    and whatever killed writers or pruners left (temp and trash directories, half-deleted
    checkpoints). Each goes by an atomic rename to a trash name first."""
    if keep <= 0:
        return
    ckpts = sorted((k, d) for d in root.iterdir() if (k := _complete(d)) is not None)
    keep_names = {d.name for _, d in ckpts[-keep:]} | {current}
    doomed = [d for _, d in ckpts if d.name not in keep_names]
    doomed += [d for d in root.iterdir() if _NAME.match(d.name) and d.is_dir() and _complete(d) is None]
    for d in doomed:
        trash = root / f".trash-{d.name}-{os.getpid()}"
        try:
            os.rename(d, trash)
        except OSError:
            continue
        shutil.rmtree(trash, ignore_errors=True)
    for d in root.iterdir():  # left by writers or pruners that were killed
        if d.name.startswith(".trash-ckpt-") or (d.name.startswith(".tmp-ckpt-") and not d.name.endswith(f"-{os.getpid()}")):
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


def read_state(path) -> dict:
    """A checkpoint's verified state.json alone (its settings), without its tensors."""
    d = resolve(path)
    try:
        state = json.loads((d / "state.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoracError(f"corrupt checkpoint {d}: state.json unreadable ({type(e).__name__})") from None
    _check_state(d, state)
    return state


def load_checkpoint(path, model_hash: str | None = None, graph_hash: str | None = None, *,
                    optimizer: bool = True) -> Checkpoint:
    """Read and verify a checkpoint (directory or root with `latest`); with optimizer=False its
    AdamW moments are verified but not read (m and v empty: eval, generate, export).

    Raises LoracError with one line for a missing, corrupt, foreign-format checkpoint or, when
    `model_hash`/`graph_hash` are given, one made for another model or artifact.
    """
    d = resolve(path)
    state = read_state(d)
    for f, digest in state["files"].items():
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
        optim = load_file(str(d / "optim.safetensors")) if optimizer else None
    except (OSError, SafetensorError) as e:
        raise LoracError(f"corrupt checkpoint {d}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    if optim is None:
        return Checkpoint(d, state["step"], lora, {}, {}, state)
    m = {k: optim.get(f"{k}.m") for k in lora}
    v = {k: optim.get(f"{k}.v") for k in lora}
    missing = [k for k in lora if m[k] is None or v[k] is None]
    if missing:
        raise LoracError(f"corrupt checkpoint {d}: no optimizer state for {missing[0]}")
    return Checkpoint(d, state["step"], lora, m, v, state)


def _check_state(d: Path, state) -> None:
    """Refuse a state.json of another format, one whose seal fails, or one missing a field."""
    fmt = state.get("format") if isinstance(state, dict) else None
    if fmt == "lorac-checkpoint-1":
        raise LoracError(f"checkpoint {d} has format {fmt}, written before checkpoints were checksummed; "
                         "it cannot be verified (train again to make a verifiable one)")
    if fmt != FORMAT:
        raise LoracError(f"not a lorac checkpoint ({d / 'state.json'} has format {fmt!r}, expected {FORMAT!r})")
    if not integrity.seal_ok(state, SEAL):
        raise LoracError(f"corrupt checkpoint {d}: state.json does not match its checksum (edited or damaged)")
    step, files = state.get("step"), state.get("files")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise LoracError(f"corrupt checkpoint {d}: state.json has no valid step")
    if not isinstance(files, dict) or sorted(files) != sorted(TENSOR_FILES) or \
            not all(isinstance(x, str) for x in files.values()):
        raise LoracError(f"corrupt checkpoint {d}: state.json does not record the checksums of {' and '.join(TENSOR_FILES)}")
