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


def inlined_blocks(func):
    """(schedule, block infos) of a PrimFunc after DLight's normalization and inlining, or
    None when it is not a PrimFunc DLight can normalize: where lorac's own schedule rules
    (cpu_schedule.ParallelFallback, gpu_generic's RowReduction) start."""
    from tvm import s_tir, tirx
    from tvm.s_tir.dlight.analysis import normalize_prim_func
    from tvm.s_tir.dlight.base import try_inline

    if not isinstance(func, tirx.PrimFunc):
        return None
    sch = s_tir.Schedule(func)
    infos = normalize_prim_func(sch)
    return None if infos is None else (sch, try_inline(sch, infos))
