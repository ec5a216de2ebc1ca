"""Relax passes shared by the GPU targets.

`legalize_passes` is TVM's CUDA legalize phase (legalize, fuse, DLight default schedules)
with one change: a DLight rule that raises on a kernel it claims (0.27's GPU Reduction rule
asserts on the Mamba scan's fused contraction in fp32) counts as declining it, so the next
rule (GeneralReduction, then Fallback) schedules that kernel instead of the build failing.
Reductions that every DLight rule declines get `RowReduction` (compiler/targets/_gpu_schedule.py) before
Fallback; a target may put its own rules first (CUDA: vectorized elementwise kernels and a
warp per short row).

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


def default_schedules(first_rules: tuple = ()):
    """The pass that gives every kernel not yet scheduled its DLight schedule: `first_rules`,
    a target's own rules (compiler/targets/_gpu_schedule.py), then DLight's, then RowReduction, then Fallback."""
    from tvm.s_tir import dlight as dl

    from ._gpu_schedule import RowReduction

    rules = [*first_rules, dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.GeneralReduction(),
             RowReduction()]
    return dl.ApplyDefaultSchedule(*[_guarded(r) for r in rules], dl.gpu.Fallback())


def legalize_passes(target, first_rules: tuple = (), tuned=None) -> list:
    """`first_rules`: a target's own schedule rules, tried before DLight's (compiler/targets/_gpu_schedule.py);
    `tuned`: a pass that schedules the kernels --tune found faster schedules for, first."""
    from tvm import relax

    from ..passes.lookups import InjectiveLookups

    t = relax.transform
    return [t.LegalizeOps(), t.AnnotateTIROpPattern(), InjectiveLookups, t.FoldConstant(), t.FuseOps(), t.FuseTIR(),
            *([tuned] if tuned is not None else []), default_schedules(first_rules)]


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
