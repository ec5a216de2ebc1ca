"""Cache keys: a canonical digest of whole specs plus the versions that built them.

A key is never a hand-picked list of fields: `canonical` walks every field of a dataclass
(`dataclasses.fields`, so also fields left out of its repr or its equality), records the
class's name, and writes containers, ranges and floats in one fixed form. A field added to
a spec is part of every key at once (tests/test_cache_keys.py changes each field of each
keyed dataclass and checks that the key moves).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
import json
import math
from importlib import metadata
from pathlib import Path


def canonical(x):
    """A JSON-able form of `x` in which different values stay different (1 and 1.0, a tuple
    and a range, two dataclasses with equal fields but different classes)."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {"__class__": type(x).__qualname__,
                **{f.name: canonical(getattr(x, f.name)) for f in dataclasses.fields(x)}}
    if isinstance(x, bool) or x is None or isinstance(x, str):
        return x
    if isinstance(x, int):
        return {"int": x}
    if isinstance(x, float):
        return {"float": repr(x) if not math.isfinite(x) else x.hex()}
    if isinstance(x, range):
        return {"range": [x.start, x.stop, x.step]}
    if isinstance(x, (tuple, list)):
        return {type(x).__name__: [canonical(v) for v in x]}
    if isinstance(x, dict):
        return {"dict": [[canonical(k), canonical(v)] for k, v in sorted(x.items(), key=lambda kv: repr(kv[0]))]}
    if hasattr(x, "dtype") and hasattr(x, "tolist"):  # numpy scalars and arrays
        return {"array": str(x.dtype), "value": canonical(x.tolist())}
    raise TypeError(f"cannot build a cache key from a {type(x).__name__}: {x!r}")


def digest(*parts) -> str:
    """sha256 (hex) of the canonical form of `parts`."""
    text = json.dumps([canonical(p) for p in parts], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def lorac_version() -> str:
    import lorac
    return lorac.__version__


def tvm_version() -> str:
    """The installed apache-tvm distribution, read without importing tvm (cache paths stay fast)."""
    try:
        return metadata.version("apache-tvm")
    except metadata.PackageNotFoundError:
        return "unknown"


@functools.cache
def source_digest(*packages: str) -> str:
    """sha256 over the Python source of `packages` (e.g. "lorac.graphs"), found without
    importing them: any change to an emitter or a compiler pass changes it."""
    h = hashlib.sha256()
    for pkg in packages:
        for folder in importlib.util.find_spec(pkg).submodule_search_locations:
            for f in sorted(Path(folder).rglob("*.py")):
                h.update(f.relative_to(folder).as_posix().encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def versions() -> dict:
    """What built an artifact, besides its inputs: lorac's version and source, TVM's version."""
    return {"lorac_version": lorac_version(), "tvm_version": tvm_version(),
            "lorac_source": source_digest("lorac.core", "lorac.graphs", "lorac.compiler")}
