"""manifest.json: everything the runtime needs to check and call an artifact.

An artifact directory holds the compiled library, optional device code, and this file.
Fields (docs/COMPILER.md has the full table):

    format, format_version      "lorac-artifact", 2
    graph_sha256, target, dtype, tune
                                what was built: the BuildRequest (below); `target` here is
                                {"family", "request", "device", "tvm"}, its request the key's
    lorac_version, tvm_version, lorac_source
                                who built it (lorac_source: sha256 of the source of lorac.core,
                                lorac.graphs and lorac.compiler)
    graph_sha256                sha256 of the serialized source ONNX graph
    target                      {"family": "cpu"|"cuda"|..., "tvm": <tvm target dict>}
    dtype                       "float32" | "bfloat16" (compute dtype of frozen weights/GEMMs)
    library                     file name of the compiled module in the directory
    inputs / outputs            [{"name", "shape", "dtype", ...}] in call order; "name" is the
                                ONNX name, "relax_name" the frontend's renamed parameter
    gemm                        {"dispatched": n, "left_to_tvm": [...]}
    extra                       per-target fields (e.g. the CUDA fatbin file)
    files                       {file name: sha256} of every other file in the directory
    manifest_sha256             sha256 of this manifest without this field (its seal)

The runtime verifies `files` and the seal before it loads anything (core/artifact_cache.py).
The cache key of a build is every field of its BuildRequest (graph_sha256, target request,
dtype, tune) plus the versions above (lorac.core.keys.versions): any change rebuilds.
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

FORMAT_VERSION = 2  # 2: files and manifest_sha256 (entries of version 1 are rebuilt)


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


def write(art_dir: Path, manifest: dict) -> Path:
    """Write `manifest` into a finished build, with the sha256 of every file there, sealed."""
    path = Path(art_dir) / FILE
    files = {f: integrity.sha256_file(Path(art_dir) / f) for f in integrity.files_below(art_dir) if f != FILE}
    manifest = integrity.seal({**manifest, "files": files}, SEAL)
    atomic.write_text(path, json.dumps(manifest, indent=1) + "\n")  # a reader never sees half a manifest
    return path


def read(art_dir: Path) -> dict | None:
    try:
        return read_manifest(art_dir)
    except (LoracError, OSError):
        return None


def matches(manifest: dict | None, key: dict, art_dir: Path) -> bool:
    """True when `manifest` was built from the same key and the directory passes verification."""
    if manifest is None or manifest.get("format_version") != FORMAT_VERSION:
        return False
    if any(manifest.get(k) != v for k, v in key.items() if k != "target"):
        return False
    if manifest.get("target", {}).get("request") != key["target"]:
        return False
    try:
        verify(art_dir, manifest)
    except (LoracError, OSError):
        return False
    return True
