"""Replacing files and directories so that a reader (or a kill) sees the old or the new
content, never a mix: write beside the destination, then rename over it."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


def fsync_path(path) -> None:
    """fsync a file or a directory (a directory's fsync makes the names in it durable).
    Windows cannot open a directory as a file, and NTFS commits renames with its metadata
    journal: there a directory needs no fsync."""
    if os.name == "nt" and os.path.isdir(path):
        return
    fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if os.path.isdir(path) else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text(path, text: str, durable: bool = False) -> None:
    """Replace file `path` with `text`; durable: fsync the file and its directory too."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if durable:
        fsync_path(path.parent)


def replace_dir(new, dest) -> Path:
    """Put finished directory `new` in place of `dest` (whatever was there goes)."""
    dest = Path(dest)
    old = None
    if dest.exists() or dest.is_symlink():
        old = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old-", dir=dest.parent))
        os.replace(dest, old / "x")
    os.rename(new, dest)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return dest
