"""Where an export may write, and how it writes: whole or not at all, and only over its own.

- `check_destination` refuses an output that is, holds or lies inside a path the export reads
  (the base model, the checkpoint): `lorac export --format merged --out <the base model>` would
  otherwise overwrite the weights it merges into.
- `staged` writes an export into a hidden sibling of its destination and renames it into
  place only when complete, so a failure (disk full, a bad tensor) leaves the destination as
  it was. A directory export (peft, merged) carries lorac's marker file (MARKER); an existing
  directory is replaced only when it is empty, or carries the marker and holds nothing but
  files an export of that kind writes: a folder holding another model, or anything of the
  user's, is refused. A file export (gguf, gguf-merged, onnx) replaces an existing file only
  when that file is of its own format (GGUF's magic; an ONNX protobuf's first field).
  A symbolic link at --out is refused: replacing it would put the export where the user did
  not look, and following it would write where the user did not point.
"""
from __future__ import annotations

import fnmatch
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from safetensors import SafetensorError

from lorac.core import atomic
from ..errors import LoracError

MARKER = ".lorac-export.json"  # in every directory an export writes: {"written_by", "format", "lorac_version"}
MAGIC = {"gguf": b"GGUF", "onnx": b"\x08"}  # what an existing file must start with to be replaced (module doc)


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


def check_replaceable(out, owned, legacy: bool = False, label: str | None = None) -> None:
    """Refuse to replace directory `out` unless it is absent or empty, or an earlier export
    wrote it: lorac's MARKER and nothing but files matching `owned`. `legacy`: a directory
    without the marker passes when it holds only owned files (a run folder's adapter/ written
    before markers existed). `label`: how messages name `out` (default: --out OUT)."""
    out = Path(out)
    label = label or f"--out {out}"
    if out.is_symlink():
        raise LoracError(f"{label} is a symbolic link (to {os.readlink(out)}); give the directory itself")
    if out.exists() and not out.is_dir():
        raise LoracError(f"{label} is a file; this export writes a directory")
    entries = sorted(out.iterdir()) if out.is_dir() else []
    if not entries:
        return
    foreign = [f.name for f in entries if f.name != MARKER and
               (f.is_symlink() or not f.is_file() or not any(fnmatch.fnmatch(f.name, o) for o in owned))]
    if foreign:
        raise LoracError(f"{label} holds {foreign[0]}, which an export does not write; "
                         "choose a new or empty directory")
    if not legacy and not marked(out):
        raise LoracError(f"{label} holds {entries[0].name} but no {MARKER}: lorac's export did not write it, "
                         "so it is not replaced; choose a new or empty directory (or delete it first)")


def marked(folder: Path) -> bool:
    try:
        mark = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(mark, dict) and mark.get("written_by") == "lorac"


def write_marker(folder, fmt: str) -> None:
    from lorac import __version__
    (Path(folder) / MARKER).write_text(json.dumps({"written_by": "lorac", "format": fmt,
                                                   "lorac_version": __version__}) + "\n")


def _check_file(out: Path, fmt: str | None) -> None:
    if out.is_symlink():
        raise LoracError(f"--out {out} is a symbolic link (to {os.readlink(out)}); give the file itself")
    if out.is_dir():
        raise LoracError(f"--out {out} is a directory; this export writes one file (e.g. {out / 'adapter.gguf'})")
    if out.exists():
        magic = MAGIC.get(fmt or "", b"")
        try:
            with open(out, "rb") as f:
                head = f.read(len(magic))
        except OSError as e:
            raise LoracError(f"--out {out}: {e.strerror or e}") from None
        if not out.is_file() or not magic or head != magic:
            raise LoracError(f"--out {out} exists and is not a {fmt or 'lorac'} file; it is not replaced: choose "
                             "a new path (or delete it first)")


@contextmanager
def staged(out, kind: str, owned=(), fmt: str | None = None, legacy: bool = False):
    """Yield a temporary path to write the export into ("dir" or "file"); on success it
    replaces `out`. `owned`: name patterns of the files an export of this kind writes;
    `fmt`: the export's format (written into a directory's MARKER; a file's magic);
    `legacy`: check_replaceable's."""
    out = Path(out)
    if kind == "dir":
        check_replaceable(out, owned, legacy)
    else:
        _check_file(out, fmt)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.export-", dir=out.parent))
    except OSError as e:
        raise LoracError(f"cannot write {out}: {e.strerror or e}") from None
    target = tmp if kind == "dir" else tmp / out.name
    try:
        yield target
        if kind == "dir":
            write_marker(tmp, fmt or "export")
            atomic.replace_dir(tmp, out)
        else:
            os.replace(target, out)
    except (OSError, SafetensorError) as e:
        raise LoracError(f"cannot write {out}: {e.strerror if isinstance(e, OSError) and e.strerror else e}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
