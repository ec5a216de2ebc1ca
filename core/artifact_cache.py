"""Artifact directories as trusted cache entries: verified before use, built aside, published whole.

An artifact is code: its library runs in the lorac process. manifest.json therefore records
the sha256 of every other file of the entry (`files`) and is sealed (`manifest_sha256`, see
integrity.py). Before a library is loaded, `verify` checks the seal, that every named file is
a plain path inside the entry with its recorded sha256, and that the entry holds no file the
manifest does not list. The runtime then loads the verified bytes from a private copy, so a
file swapped after the check is never the one that runs.

Builds go into a fresh staging directory next to the entry and are renamed into place
(`staging_dir`, `publish`); builders of one entry take its lock (`build_lock`), so two cold
runs sharing a cache compile once and never link into each other's files.
"""
from __future__ import annotations

import glob
import json
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from . import atomic
from . import integrity
from . import locks
from .errors import LoracError

from .manifest import FORMAT, Manifest

MANIFEST = "manifest.json"
SEAL = "manifest_sha256"


def read_manifest(art_dir) -> dict:
    path = Path(art_dir) / MANIFEST
    if not path.is_file():
        raise LoracError(f"{art_dir} is not a lorac artifact: no {MANIFEST}")
    try:
        m = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LoracError(f"{path}: broken manifest ({e})") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise LoracError(f"{path}: not a lorac artifact manifest (format {m.get('format') if isinstance(m, dict) else None!r})")
    return m


def load_manifest(art_dir) -> tuple[Manifest, bytes | None]:
    """(the Manifest of a verified entry, the library's bytes as they were verified): what
    the runtime loads (read_manifest, then verify, then the record)."""
    raw = read_manifest(art_dir)
    library = verify(art_dir, raw, read=raw.get("library"))
    return Manifest.from_json(raw), library


def check_output_dir(art_dir) -> None:
    """`lorac compile --out DIR` replaces DIR whole: only when it is absent, empty, or an
    artifact already (its manifest.json, of any format version, is lorac's marker; a damaged
    artifact is rebuilt). A folder of the user's, or a model, is refused in one line."""
    p = Path(art_dir)
    if p.is_symlink():
        raise LoracError(f"--out {p} is a symbolic link; give the artifact directory itself")
    if p.exists() and not p.is_dir():
        raise LoracError(f"--out {p} is a file; an artifact is a directory")
    first = next(iter(sorted(p.iterdir())), None) if p.is_dir() else None
    if first is None:
        return
    try:
        read_manifest(p)
    except (LoracError, OSError):
        raise LoracError(f"--out {p} holds {first.name} and is not a lorac artifact (no {MANIFEST} of one); "
                         "compiling replaces the directory whole, so choose a new or empty one") from None


def _named_files(m: dict) -> list:
    """File names the manifest points the runtime at: the library and path-like extras."""
    extra = m.get("extra") if isinstance(m.get("extra"), dict) else {}
    named = [m.get("library")]
    named += [v for k, v in extra.items() if isinstance(v, str) and ("/" in v or "\\" in v or v.startswith(".")
                                                                       or k.endswith(("_file", "_fatbin")))]
    return named


def verify(art_dir, m: dict, read: str | None = None) -> bytes | None:
    """Check an entry against its manifest (module doc); LoracError naming the first fault.
    With `read` (a file name), return that file's bytes as they were verified."""
    art_dir = Path(art_dir)
    if not integrity.seal_ok(m, SEAL):
        raise LoracError(f"{art_dir}: {MANIFEST} does not match its own checksum (edited or damaged)")
    files = m.get("files")
    if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
        raise LoracError(f"{art_dir}: {MANIFEST} records no file checksums")
    for name in _named_files(m):
        if name not in files:
            raise LoracError(f"{art_dir}: {MANIFEST} names {name!r}, which is not a checksummed file of the artifact")
    got = None
    for name, digest in files.items():
        path = integrity.member(art_dir, name)
        if path is None:
            raise LoracError(f"{art_dir}: {MANIFEST} names {name!r}, a path outside the artifact")
        if not path.is_file():
            raise LoracError(f"{art_dir}: {name} is missing")
        data = path.read_bytes() if name == read else None
        if (integrity.sha256_bytes(data) if data is not None else integrity.sha256_file(path)) != digest:
            raise LoracError(f"{art_dir}: {name} does not match its recorded sha256 (damaged or replaced)")
        got = data if data is not None else got
    unlisted = [f for f in integrity.files_below(art_dir) if f != MANIFEST and f not in files]
    if unlisted:
        raise LoracError(f"{art_dir}: holds {unlisted[0]}, a file its {MANIFEST} does not list")
    return got


def problem(art_dir) -> str | None:
    """None when `art_dir` is a complete, verified artifact; else why not ("missing" when absent)."""
    if not (Path(art_dir) / MANIFEST).is_file():
        return "missing"
    try:
        verify(art_dir, read_manifest(art_dir))
    except (LoracError, OSError) as e:
        return str(e)
    return None


def load_library_bytes(data: bytes, load):
    """`load(path)` on a private copy of verified library bytes (deleted once loaded)."""
    with tempfile.TemporaryDirectory(prefix="lorac-lib-") as d:  # mode 0700: only we can swap it
        path = Path(d) / "lib.so"
        path.write_bytes(data)
        return load(str(path))


# -- building ----------------------------------------------------------------------------
def _stage_prefix(art_dir: Path) -> str:
    return f".{art_dir.name}.building-"


def staging_dir(art_dir) -> Path:
    """A fresh empty directory beside `art_dir` to build it in."""
    art_dir = Path(art_dir)
    art_dir.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=_stage_prefix(art_dir), dir=art_dir.parent))


publish = atomic.replace_dir  # (stage, art_dir): a finished build in place of the entry


@contextmanager
def build_lock(art_dir, log=None):
    """Hold entry `art_dir`'s lock for a block (waiting for another builder), after clearing
    what killed builds of it left behind."""
    art_dir = Path(art_dir)
    art_dir.parent.mkdir(parents=True, exist_ok=True)
    wait = (lambda: log(f"waiting for another lorac process building {art_dir.name} ...")) if log else None
    with locks.held(art_dir.with_name(art_dir.name + ".lock"), on_wait=wait):
        for prefix in (_stage_prefix(art_dir), f".{art_dir.name}.old-"):  # old-: atomic.replace_dir's
            for p in art_dir.parent.glob(glob.escape(prefix) + "*"):
                shutil.rmtree(p, ignore_errors=True)
        yield
