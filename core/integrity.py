"""Checksums and path checks shared by artifacts (manifest.json) and checkpoints (state.json).

A record is *sealed* by storing, under one of its own keys, the sha256 of its canonical JSON
(sorted keys, no spaces) without that key: any edit of the record (a step, a swapped input
name, a deleted `files` entry) breaks the seal. A seal finds corruption and careless edits,
not an attacker who rewrites the record and its seal together (docs/RUNTIME.md, trust model).
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def sha256_json(obj) -> str:
    """sha256 of a JSON-able value in canonical form (sorted keys, no spaces)."""
    return sha256_bytes(json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode())


def seal(record: dict, key: str) -> dict:
    """`record` with `key` set to the sha256 of the rest of it."""
    rest = {k: v for k, v in record.items() if k != key}
    return {**rest, key: sha256_json(rest)}


def seal_ok(record: dict, key: str) -> bool:
    return isinstance(record.get(key), str) and record[key] == sha256_json({k: v for k, v in record.items() if k != key})


def member(root, name) -> Path | None:
    """The path of file `name` inside directory `root`, or None when `name` is not a plain
    relative path that stays inside it (absolute, `..`, a link that leads out)."""
    if not isinstance(name, str) or not name or "\\" in name or "\0" in name or os.path.isabs(name):
        return None
    parts = name.split("/")
    if any(p in ("", ".", "..") for p in parts):
        return None
    root = Path(root)
    path = root.joinpath(*parts)
    try:
        inside = path.resolve().is_relative_to(root.resolve())
    except (OSError, RuntimeError):  # a link loop
        return None
    return path if inside and not path.is_symlink() else None


def files_below(root) -> list[str]:
    """Every regular file under `root` (links not followed), as sorted `a/b` relative names."""
    root = Path(root)
    out = []
    for folder, dirs, files in os.walk(root):
        rel = Path(folder).relative_to(root)
        out += [(rel / f).as_posix() for f in files]
    return sorted(out)
