"""Advisory file locks (POSIX flock): one training run per output directory, one builder
per artifact cache entry. The kernel drops a lock when its holder dies, so a kill -9 never
leaves a stale lock behind; the lock file itself (holding the holder's pid) may stay.
"""
from __future__ import annotations

import errno
import fcntl
import os
import stat
from contextlib import contextmanager
from pathlib import Path

from .errors import LoracError


class Lock:
    def __init__(self, path: Path, fd: int):
        self.path, self._fd = path, fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None


def acquire(path, wait: bool = True) -> Lock | None:
    """An exclusive lock on file `path` (created if needed): None when another process holds
    it and `wait` is false. The holder's pid is written into the file for messages."""
    path = Path(path)
    try:  # never through a link planted at the name: the pid below would overwrite its target
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise LoracError(f"{path} is a symbolic link; lorac does not lock or write through links "
                             "(remove it)") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:  # a FIFO, a device, another file's hard link
            raise LoracError(f"{path} is not a plain file of its own; lorac keeps its lock there (remove it)")
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return Lock(path, fd)


def holder(path) -> str:
    """The pid written by the lock's holder, or '?'."""
    try:
        return Path(path).read_text().strip() or "?"
    except OSError:
        return "?"


@contextmanager
def held(path, on_wait=None):
    """Hold the lock on `path` for a block, waiting for it; `on_wait()` is called first if
    another process holds it (to say what is being waited for)."""
    lock = acquire(path, wait=False)
    if lock is None:
        if on_wait:
            on_wait()
        lock = acquire(path, wait=True)
    try:
        yield lock
    finally:
        lock.release()
