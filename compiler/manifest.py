"""manifest.json: everything the runtime needs to check and call an artifact.

An artifact directory holds the compiled library, optional device code, and this file.
Fields (docs/COMPILER.md has the full table):

    format, format_version      "lorac-artifact", 1
    lorac_version, tvm_version  who built it
    graph_sha256                sha256 of the serialized source ONNX graph
    target                      {"family": "cpu"|"cuda"|..., "tvm": <tvm target dict>}
    dtype                       "float32" | "bfloat16" (compute dtype of frozen weights/GEMMs)
    library                     file name of the compiled module in the directory
    inputs / outputs            [{"name", "shape", "dtype", ...}] in call order; "name" is the
                                ONNX name, "relax_name" the frontend's renamed parameter
    gemm                        {"dispatched": n, "left_to_tvm": [...]}
    extra                       per-target fields (e.g. the CUDA fatbin file)

The cache key of a build is (graph_sha256, target, dtype, lorac_version, tvm_version): any
change rebuilds.
"""
from __future__ import annotations

import hashlib
import json
from importlib import metadata
from pathlib import Path

FORMAT = "lorac-artifact"
FORMAT_VERSION = 1
FILE = "manifest.json"


def lorac_version() -> str:
    import lorac
    return lorac.__version__


def tvm_version() -> str:
    # the installed distribution, read without importing tvm (the cache path stays fast)
    try:
        return metadata.version("apache-tvm")
    except metadata.PackageNotFoundError:
        return "unknown"


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def cache_key(graph_sha256: str, target: dict, dtype: str, tune: int = 0) -> dict:
    return {"graph_sha256": graph_sha256, "target": target, "dtype": dtype, "tune": tune,
            "lorac_version": lorac_version(), "tvm_version": tvm_version()}


def write(art_dir: Path, manifest: dict) -> Path:
    path = Path(art_dir) / FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    tmp.replace(path)  # a reader never sees half a manifest
    return path


def read(art_dir: Path) -> dict | None:
    path = Path(art_dir) / FILE
    if not path.is_file():
        return None
    try:
        m = json.loads(path.read_text())
    except json.JSONDecodeError:
        return None
    return m if m.get("format") == FORMAT else None


def matches(manifest: dict | None, key: dict, art_dir: Path) -> bool:
    """True when `manifest` was built from the same key and its library is still there."""
    if manifest is None or manifest.get("format_version") != FORMAT_VERSION:
        return False
    if any(manifest.get(k) != v for k, v in key.items() if k != "target"):
        return False
    if manifest.get("target", {}).get("request") != key["target"]:
        return False
    return (Path(art_dir) / manifest.get("library", "")).is_file()
