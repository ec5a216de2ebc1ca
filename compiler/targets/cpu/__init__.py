"""Host CPU (LLVM): GEMMs on the BLAS numpy links, every other op a fused TVM kernel.

The target is the compiling machine's own CPU (LLVM's name for it as -mcpu), so the
artifact is for this host or one of the same CPU family. Artifact: `lib.so`, a shared
library linked with the system C compiler.
"""
from __future__ import annotations

from .._common import export_shared_library as export  # noqa: F401 - target interface

FAMILY = "cpu"
DEVICE = "cpu"
GEMM_LIBRARY = True  # a CBLAS (OpenBLAS, MKL) through lorac.runtime.devices.cpu.blas
# sums of GEMMs as one call (passes/gemm_sum.py): the later terms add into the output with
# beta = 1 instead of an extra pass over it
ACCUMULATING_GEMMS = True
ARENA_PLAN = True  # one arena for the planned tensors (compiler/memory_plan.py)
DTYPES = ("float32",)  # numpy has no bf16 GEMM: bf16 is a GPU option


def prepare(mod):
    """exp/sigmoid/softmax that vectorize (compiler/passes/fast_math.py), gathers without TVM's fast-mode
    warning (compiler/passes/take_bounds.py); imported here, not at the top, so a cache hit never imports TVM."""
    from ...passes.fast_math import fast_math
    from ...passes.take_bounds import clip_takes
    return clip_takes(fast_math(mod))


def native_units(dtype: str) -> dict:
    """Mamba's selective scan units become lorac's own TIR kernels (compiler/units/scan.py); every
    other unit is inlined."""
    from ...units.scan import converters
    return converters(gpu=False)


def tvm_target(request: dict):
    import tvm
    from tvm.target import codegen

    spec = {k: v for k, v in request.items() if k != "kind"}
    spec.setdefault("mcpu", codegen.llvm_get_system_cpu())
    return tvm.target.Target({"kind": "llvm", **spec})


def check_environment(request: dict) -> None:
    """Linking the library needs the C compiler TVM links with: $CXX or $CC, else g++, gcc,
    clang++, clang, c++ or cc on Linux and macOS; clang (or $TVM_WIN_CC) on Windows."""
    import os
    import shutil
    import sys

    from lorac.core.errors import LoracError

    if sys.platform == "win32":
        if not shutil.which(os.environ.get("TVM_WIN_CC", "clang")):
            raise LoracError("target cpu needs clang on the PATH (or TVM_WIN_CC) to link the artifact library")
        return
    from tvm.support.cc import get_cc
    if not get_cc():
        raise LoracError("target cpu needs a C compiler (g++, gcc, clang or cc on the PATH, or $CC) to link the "
                         "artifact library")


def tune(mod, target, trials: int, cache_dir):
    """--tune: MetaSchedule for the non-GEMM kernels, records kept in cache_dir (tune.py)."""
    from .tuning import TUNER
    from ...tune import tune as ms_tune

    return ms_tune(mod, target, trials, cache_dir, TUNER, relax_passes)


def relax_passes(target) -> list:
    """Legalize, fuse, put tuned schedules (--tune) on the kernels that have one, give every
    other fused kernel a parallel loop (cpu_schedule), lower."""
    from tvm.relax.backend.cpu_generic import pipeline as cpu_generic

    from .schedule import ParallelizeCPU
    from .tuning import TUNER
    from ...passes.lookups import InjectiveLookups
    from ...tune import ApplyTuned

    legalize = cpu_generic.legalize_passes(target)  # legalize, annotate, fold, fuse: small lookups fuse
    at = [p.info.name for p in legalize].index("AnnotateTIROpPattern") + 1
    legalize.insert(at, InjectiveLookups)
    return (cpu_generic.library_dispatch_passes(target) + legalize
            + [ApplyTuned(target, TUNER), ParallelizeCPU(target)]
            + cpu_generic.dataflow_lower_passes(target) + cpu_generic.finalize_passes(target))
