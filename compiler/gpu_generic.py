"""Relax passes shared by the GPU targets.

`legalize_passes` is TVM's CUDA legalize phase (legalize, fuse, DLight default schedules)
with one change: a DLight rule that raises on a kernel it claims (0.27's GPU Reduction rule
asserts on the Mamba scan's fused contraction in fp32) counts as declining it, so the next
rule (GeneralReduction, then Fallback) schedules that kernel instead of the build failing.
Reductions that every DLight rule declines (0.27's rules take sums but not `max`: the loss's
row max over the vocabulary fell to Fallback, one thread per row, 79 ms of a 347 ms Qwen3-0.6B
step on the H200) get `RowReduction` before Fallback.

`relax_passes` is the whole pipeline of the GPU targets that have no vendor GEMM library in
lorac (OpenCL, WebGPU, ROCm, Metal): every op, matmuls included, is a TVM kernel."""
from __future__ import annotations


def _guarded(rule):
    from tvm.s_tir.dlight.base import ScheduleRule

    class Guarded(ScheduleRule):
        def apply(self, func, target, tunable):
            try:
                return rule.apply(func, target, tunable)
            except (AssertionError, ValueError, IndexError, RuntimeError):  # TVM's errors derive from these
                return None

        def is_target_available(self, target) -> bool:
            return rule.is_target_available(target)

    return Guarded()


_THREADS = 256
_MIN_EXTENT = 4 * _THREADS


def _row_reduction():
    from tvm.s_tir.dlight.base import ScheduleRule
    from tvm.s_tir.dlight.base.utils import get_extent

    from .target_common import inlined_blocks

    class RowReduction(ScheduleRule):
        """One reduction block (after inlining its injective producers), spatial axes
        before reduced ones, reducing at least 1024 elements (a vocabulary row): spatial
        axes fused across thread blocks, reduced axes fused and split across 256 threads,
        which TVM lowers to a cross-thread (warp shuffle) reduction with coalesced reads."""

        def apply(self, func, target, _tunable):
            found = inlined_blocks(func)
            if found is None:
                return None
            sch, infos = found
            if len(infos) != 1:
                return None
            kinds = infos[0].dom_kind()
            n_s = len(kinds) - len(kinds.lstrip("S"))
            if "R" not in kinds or set(kinds[n_s:]) != {"R"}:
                return None
            block = infos[0].block_rv
            loops = sch.get_loops(block)
            if len(loops) != len(kinds):
                return None
            extent = 1
            for lp in loops[n_s:]:
                e = get_extent(sch, lp)
                extent = extent * e if isinstance(e, int) else 0
            if extent < _MIN_EXTENT:  # short reductions (GQA's head groups, Mamba's chunk) stay
                return None  # with Fallback: one thread per output beats 256 mostly idle ones
            if n_s:
                sch.bind(sch.fuse(*loops[:n_s]) if n_s > 1 else loops[0], "blockIdx.x")
            red = sch.fuse(*loops[n_s:]) if len(loops) - n_s > 1 else loops[n_s]
            _, tx = sch.split(red, factors=[None, _THREADS])
            sch.bind(tx, "threadIdx.x")
            return sch

    return RowReduction()


def legalize_passes(target) -> list:
    from tvm import relax
    from tvm.s_tir import dlight as dl

    t = relax.transform
    rules = [dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.GeneralReduction()]
    return [t.LegalizeOps(), t.AnnotateTIROpPattern(), t.FoldConstant(), t.FuseOps(), t.FuseTIR(),
            dl.ApplyDefaultSchedule(*[_guarded(r) for r in rules], _guarded(_row_reduction()), dl.gpu.Fallback())]


def relax_passes(target) -> list:
    from tvm import relax
    from tvm.relax.backend.cuda import (
        pipeline as gpu,  # these phases are target-generic
    )

    t = relax.transform
    finalize = [t.StaticPlanBlockMemory(), t.LowerAllocTensor(), t.KillAfterLastUse(), t.LowerRuntimeBuiltin(),
                t.ComputePrimValue(), t.VMShapeLower(), t.AttachGlobalSymbol()]  # CUDA's, minus CUDA graphs
    return (gpu.library_dispatch_passes(target) + legalize_passes(target)
            + gpu.dataflow_lower_passes(target) + finalize)


def compile_error(family: str, err: Exception):
    """Wrap a TVM build failure in one lorac error that names the target."""
    from lorac.runtime.errors import LoracError
    msg = str(err).strip().splitlines()
    return LoracError(f"TVM could not build for target {family}: {msg[-1] if msg else type(err).__name__}")
