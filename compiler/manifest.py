"""manifest.json: everything the runtime needs to check and call an artifact.

An artifact directory holds the compiled library, optional device code, and this file.
Fields (docs/COMPILER.md has the full table):

    format, format_version      "lorac-artifact", 2
    lorac_version, tvm_version  who built it
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

The runtime verifies `files` and the seal before it loads anything (runtime/artifact_cache.py).
The cache key of a build is (graph_sha256, target, dtype, lorac_version, tvm_version): any
change rebuilds.
"""
from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path

from lorac.runtime import atomic, integrity
from lorac.runtime.integrity import sha256_bytes  # noqa: F401 (pipeline's)
from lorac.runtime.artifact_cache import FORMAT, SEAL, publish, read_manifest, staging_dir, verify  # noqa: F401
from lorac.runtime.artifact_cache import MANIFEST as FILE
from lorac.runtime.errors import LoracError

FORMAT_VERSION = 2  # 2: files and manifest_sha256 (entries of version 1 are rebuilt)


def lorac_version() -> str:
    import lorac
    return lorac.__version__


def tvm_version() -> str:
    # the installed distribution, read without importing tvm (the cache path stays fast)
    try:
        return metadata.version("apache-tvm")
    except metadata.PackageNotFoundError:
        return "unknown"


def cache_key(graph_sha256: str, target: dict, dtype: str, tune: int = 0) -> dict:
    return {"graph_sha256": graph_sha256, "target": target, "dtype": dtype, "tune": tune,
            "lorac_version": lorac_version(), "tvm_version": tvm_version()}


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
