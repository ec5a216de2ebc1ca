"""Pieces of the target interface (see pipeline.py) that several target families share."""
from __future__ import annotations

from pathlib import Path


def host_gpu_target(kind: str, request: dict, **defaults):
    """A TVM target of `kind` with an LLVM host, request settings over `defaults`."""
    import tvm
    spec = {**defaults, **{k: v for k, v in request.items() if k != "kind"}}
    return tvm.target.Target({"kind": kind, **spec, "host": {"kind": "llvm"}})


def no_environment_check(request: dict) -> None:
    """Targets whose build needs nothing beyond TVM itself."""


def unchanged(mod):
    """No target-specific Relax rewrite."""
    return mod


def export_shared_library(ex, art_dir: Path, target) -> dict:
    """The artifact's library as one shared object linked by the system compiler."""
    ex.export_library(str(Path(art_dir) / "lib.so"))
    return {"library": "lib.so"}
