"""manifest.json: everything the runtime needs to check and call an artifact.

An artifact directory holds the compiled library, optional device code, and this file, the
record lorac.core.manifest.Manifest as JSON (its docstring and docs/COMPILER.md list the
fields). The runtime verifies `files` and the seal before it loads anything
(core/artifact_cache.py). The cache key of a build is every field of its BuildRequest
(graph_sha256, target request, dtype, tune) plus the versions that built it
(lorac.core.keys.versions): any change rebuilds.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from lorac.core import atomic
from lorac.core import integrity
from lorac.core.artifact_cache import FORMAT, SEAL, publish, read_manifest, staging_dir, verify  # noqa: F401
from lorac.core.artifact_cache import MANIFEST as FILE
from lorac.core.errors import LoracError
from lorac.core.integrity import sha256_bytes  # noqa: F401 (pipeline's)
from lorac.core.keys import tvm_version, versions  # noqa: F401 (pipeline's)
from lorac.core.manifest import FORMAT_VERSION, Manifest, Target  # noqa: F401 (pipeline's)


@dataclass(frozen=True)
class BuildRequest:
    """What one compile_graph call builds: with `versions()`, its whole cache key."""
    graph_sha256: str  # sha256 of the serialized source ONNX graph
    target: dict  # the target request: {"kind": family, ...} (pipeline.resolve_target)
    dtype: str  # compute dtype: "float32" | "bfloat16"
    tune: int = 0  # MetaSchedule trials (cpu)


def cache_key(request: BuildRequest) -> dict:
    """Every field of `request` and every version (a field added to either is keyed at once)."""
    return {**asdict(request), **versions()}


def write(art_dir: Path, manifest: Manifest) -> Path:
    """Write `manifest` into a finished build, with the sha256 of every file there, sealed."""
    path = Path(art_dir) / FILE
    files = {f: integrity.sha256_file(Path(art_dir) / f) for f in integrity.files_below(art_dir) if f != FILE}
    manifest = integrity.seal({**manifest.to_json(), "files": files}, SEAL)
    atomic.write_text(path, json.dumps(manifest, indent=1) + "\n")  # a reader never sees half a manifest
    return path


def read(art_dir: Path) -> dict | None:
    """The manifest.json object of `art_dir` (not yet verified), or None."""
    try:
        return read_manifest(art_dir)
    except (LoracError, OSError):
        return None


def matches(manifest: dict | None, key: dict, art_dir: Path) -> bool:
    """True when `manifest` was built from the same key and the directory passes verification."""
    if manifest is None or manifest.get("format_version") != FORMAT_VERSION:
        return False
    built = Manifest.from_json(manifest).key_fields()
    if any(built.get(k) != v for k, v in key.items()):
        return False
    try:
        verify(art_dir, manifest)
    except (LoracError, OSError):
        return False
    return True
