"""Where an export may write, and how it writes: whole or not at all.

- `check_destination` refuses an output that is, holds or lies inside a path the export reads
  (the base model, the checkpoint): `lorac export --format merged --out <the base model>` would
  otherwise overwrite the weights it merges into.
- `staged` writes an export into a hidden sibling of its destination and renames it into
  place only when complete, so a failure (disk full, a bad tensor) leaves the destination as
  it was. A directory destination that already exists is replaced only when it holds nothing
  but files an export of that kind writes (a previous export); anything else is refused.
"""
from __future__ import annotations

import fnmatch
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from safetensors import SafetensorError

from lorac.core import atomic
from ..errors import LoracError


def check_destination(out, protected) -> None:
    """Refuse `out` when it is, holds, or lies inside one of the `protected` paths."""
    dest = os.path.realpath(out)
    for p in protected:
        if p is None:
            continue
        real = os.path.realpath(p)
        what = "is" if real == dest else "holds" if _inside(real, dest) else "lies inside" if _inside(dest, real) else None
        if what:
            raise LoracError(f"--out {out} {what} {p}, which this export reads; choose another output path")


def _inside(path: str, folder: str) -> bool:
    return path.startswith(folder.rstrip(os.sep) + os.sep)


@contextmanager
def staged(out, kind: str, owned=()):
    """Yield a temporary path to write the export into ("dir" or "file"); on success it
    replaces `out`. `owned`: name patterns of the files an export of this kind writes, the
    only ones an existing output directory may hold to be replaced."""
    out = Path(out)
    if kind == "dir" and out.is_file():
        raise LoracError(f"--out {out} is a file; this export writes a directory")
    if kind == "file" and out.is_dir():
        raise LoracError(f"--out {out} is a directory; this export writes one file (e.g. {out / 'adapter.gguf'})")
    if kind == "dir" and out.is_dir():
        foreign = [f.name for f in out.iterdir() if not f.is_file() or not any(fnmatch.fnmatch(f.name, o) for o in owned)]
        if foreign:
            raise LoracError(f"--out {out} holds {foreign[0]}, which an export does not write; "
                             "choose a new or empty directory")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.export-", dir=out.parent))
    except OSError as e:
        raise LoracError(f"cannot write {out}: {e.strerror or e}") from None
    target = tmp if kind == "dir" else tmp / out.name
    try:
        yield target
        if kind == "dir":
            atomic.replace_dir(tmp, out)
        else:
            os.replace(target, out)
    except (OSError, SafetensorError) as e:
        raise LoracError(f"cannot write {out}: {e.strerror if isinstance(e, OSError) and e.strerror else e}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
