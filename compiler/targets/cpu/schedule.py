"""Default CPU schedules for the non-GEMM kernels: inline, then one parallel loop each.

Legalized Relax ops come out as serial loop nests, so without a schedule every fused
kernel runs on one core. DLight ships a CPU rule for softmax/norm-like reductions
(`dl.cpu.Reduction`); everything else gets `ParallelFallback`: inline what can be inlined
(as DLight's GPU fallback does), then fuse each remaining block's leading spatial loops
into one `parallel` loop and vectorize an innermost spatial loop when it is the last
one. Kernels the rules cannot normalize stay serial (correct, just slower).
"""
from __future__ import annotations

from tvm.s_tir import dlight as dl
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.s_tir.dlight.base.utils import get_extent
from tvm.s_tir.schedule import ScheduleError

from .._common import inlined_blocks

_VEC = 8  # fp32 lanes of a 256-bit vector; LLVM legalizes wider or narrower hardware
_LANES = 16  # independent accumulators of a long reduction (two 256-bit vectors)


class ParallelFallback(ScheduleRule):
    def apply(self, func, target, _tunable):
        found = inlined_blocks(func)
        if found is None:
            return None
        sch, infos = found
        for info in infos:
            block = info.block_rv
            loops = sch.get_loops(block)
            kinds = info.dom_kind()
            if not loops or len(kinds) != len(loops):
                continue
            s_loops = [lp for lp, k in zip(loops, kinds) if k == "S"]
            r_loops = [lp for lp, k in zip(loops, kinds) if k != "S"]
            if not s_loops:
                continue
            sch.reorder(*s_loops, *r_loops)
            inner = None
            # vectorize the innermost spatial loop of a pure spatial block when it is
            # contiguous enough to pay off (and keep it out of the parallel fuse)
            if not r_loops and len(s_loops) >= 2:
                ext = get_extent(sch, s_loops[-1])
                if isinstance(ext, int) and ext % _VEC == 0:
                    inner = s_loops.pop()
            outer = sch.fuse(*s_loops) if len(s_loops) > 1 else s_loops[0]
            sch.parallel(outer)
            if inner is not None:
                _, vec = sch.split(inner, factors=[None, _VEC])
                sch.vectorize(vec)
            if r_loops:
                lanes = _lane_accumulators(sch, block, r_loops)
                if lanes is None:
                    sch.decompose_reduction(block, r_loops[0])
                else:
                    sch = lanes
        return sch


def _lane_accumulators(sch, block, r_loops):
    """A copy of `sch` in which the innermost reduction loop feeds _LANES independent
    accumulators (rfactor), summed once at the end, or None where the loop is short or the
    reduction is one rfactor cannot split. A plain `acc += x[k]` loop waits on the add's
    latency every element (a [1024, 32000] row sum took 16 ms of a 40M step); lanes of
    accumulators run at the adds' throughput, and LLVM vectorizes the unrolled lanes. The
    copy keeps the schedule's names for blocks and loops, so the caller can go on with it."""
    ext = get_extent(sch, r_loops[-1])
    if not isinstance(ext, int) or ext % _LANES or ext < 4 * _LANES:
        return None
    trial = sch.copy()
    try:
        _, ri = trial.split(r_loops[-1], factors=[None, _LANES])
        axis = len(trial.get(block).writes[0].region)  # the lanes: a new last axis
        rf = trial.rfactor(ri, factor_axis=axis)
        rf_loops = trial.get_loops(rf)  # [parallel, other reductions..., ro, ri]
        trial.reverse_compute_at(block, rf_loops[0])
        trial.decompose_reduction(rf, rf_loops[1])
        trial.unroll(rf_loops[-1])
    except ScheduleError:
        return None
    return trial


def ParallelizeCPU(target):  # noqa: N802 - reads like the pass it returns
    """The Relax pass that applies the CPU rules to every not-yet-scheduled kernel."""
    return dl.ApplyDefaultSchedule(dl.cpu.Reduction(), ParallelFallback())
