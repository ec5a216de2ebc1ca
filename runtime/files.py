"""File modes: what lorac writes gets the modes a plain open() would give under the user's
umask. The safetensors library creates its files with mode 0600 whatever the umask, so an
adapter or checkpoint shared through a group-readable folder was unreadable to the group."""
from __future__ import annotations

import os
from pathlib import Path


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
