"""Replacing files and directories so that a reader (or a kill) sees the old or the new
content, never a mix: write beside the destination, then rename over it."""
from __future__ import annotations

import errno
import os
import shutil
import tempfile
from contextlib import contextmanager
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


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def temp_beside(path, suffix: str = "") -> Path:
    """A new empty file beside `path` (a fresh unpredictable name, created exclusively, so a
    link planted in the folder is never followed), with the mode a plain open() would give."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix + ".tmp", dir=path.parent)
    try:
        if os.name != "nt":
            os.fchmod(fd, 0o666 & ~_umask())
    finally:
        os.close(fd)
    return Path(tmp)


@contextmanager
def replacing(path, suffix: str = ""):
    """Yield a temporary path beside `path` to write; on success it is renamed over `path`.
    The rename replaces whatever name was there, a symbolic link included, and never writes
    through it into the file it points at."""
    tmp = temp_beside(path, suffix)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_text(path, text: str, durable: bool = False) -> None:
    """Replace file `path` with `text` (never through a link at its name); durable: fsync the
    file and its directory too."""
    path = Path(path)
    with replacing(path) as tmp:
        with open(tmp, "w") as f:
            f.write(text)
            if durable:
                f.flush()
                os.fsync(f.fileno())
    if durable:
        fsync_path(path.parent)


FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
FULL_TEXT = ("No space left on device", "Disk quota exceeded", "File too large")


def no_space(e: BaseException, *folders) -> str | None:
    """Why writing failed, when it failed for want of space (ENOSPC, a quota, a file size limit;
    also when a tool such as the linker only says so in its output), naming the free space left
    in each of `folders` (where lorac wrote, and the temporary directory its tools write to);
    None for any other failure."""
    text = str(e)
    if not (isinstance(e, OSError) and e.errno in FULL) and not any(t in text for t in FULL_TEXT):
        return None
    free = []
    for folder in dict.fromkeys(str(f) for f in folders):
        try:
            st = os.statvfs(folder)
            free.append(f"{st.f_bavail * st.f_frsize / 2**20:.1f} MiB free in {folder}")
        except (OSError, AttributeError):
            pass
    what = next((t for t in FULL_TEXT if t in text), "No space left on device").lower()
    return f"{what} ({'; '.join(free) or 'no free space known'})"


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
