"""Files lorac reads and writes for the user, and how (docs/RUNTIME.md, "Trust model").

- Modes: what lorac writes gets the modes a plain open() would give under the user's umask.
  The safetensors library creates its files with mode 0600 whatever the umask, so an adapter
  or checkpoint shared through a group-readable folder was unreadable to the group.
- Reading: a model or data path must be a regular file (`check_regular`, `open_regular`):
  a FIFO would block the run for ever.
- Writing in --out: never through a symbolic link, FIFO or hard link planted at a file's name
  (`open_run_file`; whole files are written beside and renamed over the name:
  lorac.core.atomic.replacing).
"""
from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from .errors import LoracError


def current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def respect_umask(path) -> None:
    """Files under `path` (a file or a folder) to 0666 & ~umask, folders to 0777 & ~umask."""
    if os.name == "nt":  # Windows has no umask; its ACLs are inherited from the folder
        return
    mask = current_umask()
    p = Path(path)
    for item in [p] + (sorted(p.rglob("*")) if p.is_dir() else []):
        if not item.is_symlink():
            os.chmod(item, (0o777 if item.is_dir() else 0o666) & ~mask)


# -- reading: regular files only --------------------------------------------------------------
_KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"))


def _not_regular(mode: int) -> str | None:
    return next((what for test, what in _KINDS if test(mode)), None if stat.S_ISREG(mode) else "not a regular file")


def check_regular(path, what: str = "file") -> None:
    """Refuse, before anything opens it, a path that exists but is no regular file: opening a
    FIFO blocks until a writer comes (for ever, and deaf to SIGTERM inside a C library), a
    device may never end. A missing path passes: its reader says so in its own words."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return
    kind = _not_regular(mode)
    if kind:
        raise LoracError(f"{path}: is {kind}, not a {what}; lorac reads regular files only")


def open_regular(path, mode: str = "r", what: str = "file", **kw):
    """open(path, mode) for reading, refusing a FIFO, device or socket without blocking on it
    (opened non-blocking, checked with fstat, then set back to blocking)."""
    if os.name == "nt":  # no FIFOs to block on there, and no fcntl
        check_regular(path, what)
        return open(path, mode, **kw)
    import fcntl
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        kind = _not_regular(os.fstat(fd).st_mode)
        if kind:
            raise LoracError(f"{path}: is {kind}, not a {what}; lorac reads regular files only")
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        return os.fdopen(fd, mode, **kw)
    except BaseException:
        os.close(fd)
        raise


def read_json(path, what: str = "JSON file"):
    """A JSON file's value, read as a regular file; bad JSON (or nesting past Python's stack) is
    one LoracError line naming the file."""
    import json
    try:
        with open_regular(path, encoding="utf-8", what=what) as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LoracError(f"{path}: not valid JSON ({e})") from None
    except RecursionError:
        raise LoracError(f"{path}: not valid JSON (nested too deeply)") from None


# -- writing run files: never through a link ---------------------------------------------------
def open_run_file(path, append: bool = False):
    """A run file in --out (metrics.jsonl) opened for writing, text mode. A symbolic link, a
    FIFO or a hard link planted at its name is never written through: a fresh file replaces the
    name (its old target is left as it was), and appending opens with O_NOFOLLOW and refuses
    anything but a plain file of its own."""
    path = Path(path)
    nofollow = getattr(os, "O_NOFOLLOW", 0)
    flags = os.O_WRONLY | os.O_CREAT | nofollow | getattr(os, "O_CLOEXEC", 0)
    try:
        if append:
            fd = os.open(path, flags | os.O_APPEND | getattr(os, "O_NONBLOCK", 0), 0o666)
        else:
            try:
                os.unlink(path)  # removes the name only, whatever it pointed at
            except FileNotFoundError:
                pass
            fd = os.open(path, flags | os.O_EXCL, 0o666)
    except IsADirectoryError:
        raise LoracError(f"{path} is a directory; lorac writes its own file there (remove it)") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise LoracError(f"{path} is a symbolic link; lorac does not write through links in --out "
                             "(remove it)") from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
        os.close(fd)
        raise LoracError(f"{path} is not a plain file of its own (a FIFO, a device or a hard link); "
                         "lorac writes its own file there (remove it)")
    if append and os.name != "nt":
        import fcntl
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    return os.fdopen(fd, "a" if append else "w")
