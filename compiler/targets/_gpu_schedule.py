"""lorac's own DLight schedule rules for GPU kernels.

DLight 0.27's rules leave most of a training step's kernels to its Fallback: one element per
thread, 1024 threads a block. On the H200 those elementwise passes over bf16 activations ran
at about a quarter of the memory bandwidth (SwiGLU over [8192, 3072]: 133 us for 150 MB),
and DLight's own Reduction rule read the norms' 128- and 1024-element rows at a sixth of it.
- `RowReduction` (all GPU targets): a reduction over at least 1024 elements (a vocabulary
  row) that no DLight rule takes (0.27 declines `max`: the loss's row max fell to Fallback,
  one thread per row, 79 ms of a 347 ms Qwen3-0.6B step): 256 threads per row.
- `WarpRowReduction` (CUDA, before DLight's): rows of 32 to 4096 elements, one warp per row
  and 8 rows a block: the lanes read consecutive elements (coalesced) and TVM lowers the
  cross-lane sum to warp shuffles.
- `VectorizedElementwise` (CUDA, before DLight's): a kernel that is one spatial block after
  inlining (casts, adds, SiLU, RoPE): each thread handles 4 (or 2) consecutive elements as
  one vector, 128 threads a block (TVM 0.27's CUDA codegen cannot print 8-wide float
  constants, nor vectors of bools: kernels with a comparison keep Fallback).
Each returns None (declines) for a kernel that is not of its shape.
"""
from __future__ import annotations

from tvm.s_tir.dlight.base import ScheduleRule

from ._common import inlined_blocks

_THREADS = 256
_MIN_EXTENT = 4 * _THREADS


def _one_block(func, kinds_ok):
    """(schedule, loops, kinds) of a PrimFunc that is a single block after inlining,
    whose iterator kinds pass `kinds_ok`, else None."""
    found = inlined_blocks(func)
    if found is None:
        return None
    sch, infos = found
    if len(infos) != 1:
        return None
    kinds = infos[0].dom_kind()
    loops = sch.get_loops(infos[0].block_rv)
    if len(loops) != len(kinds) or not kinds_ok(kinds):
        return None
    return sch, loops, kinds


def _extent(sch, loops) -> int:
    """Product of the loops' static extents, 0 when one is symbolic."""
    from tvm.s_tir.dlight.base.utils import get_extent
    total = 1
    for lp in loops:
        e = get_extent(sch, lp)
        total = total * e if isinstance(e, int) else 0
    return total


def _n_spatial(kinds: str) -> int:
    return len(kinds) - len(kinds.lstrip("S"))


def _spatial_then_reduced(kinds: str) -> bool:
    return "R" in kinds and set(kinds[_n_spatial(kinds):]) == {"R"}


def _fused(sch, loops):
    return sch.fuse(*loops) if len(loops) > 1 else loops[0]


def _reduction(func):
    """(schedule, loops, number of spatial loops) of a one-block reduction, else None."""
    got = _one_block(func, _spatial_then_reduced)
    if got is None:
        return None
    sch, loops, kinds = got
    return sch, loops, _n_spatial(kinds)


class _Rule(ScheduleRule):
    def is_target_available(self, target) -> bool:
        return True


class RowReduction(_Rule):
    """Spatial axes fused across thread blocks, the reduced axes fused and split across 256
    threads: a cross-thread reduction with coalesced reads."""

    def apply(self, func, target, _tunable):
        got = _reduction(func)
        if got is None:
            return None
        sch, loops, n_s = got
        if _extent(sch, loops[n_s:]) < _MIN_EXTENT:  # short rows stay with the other rules
            return None
        if n_s:
            sch.bind(_fused(sch, loops[:n_s]), "blockIdx.x")
        _, tx = sch.split(_fused(sch, loops[n_s:]), factors=[None, _THREADS])
        sch.bind(tx, "threadIdx.x")
        return sch


class WarpRowReduction(_Rule):
    """One warp per row of 32..4096 elements, 8 rows a block."""

    ROWS = 8

    def apply(self, func, target, _tunable):
        got = _reduction(func)
        if got is None:
            return None
        sch, loops, n_s = got
        n_rows, length = _extent(sch, loops[:n_s]), _extent(sch, loops[n_s:])
        if not n_s or not 32 <= length <= 4096 or n_rows < self.ROWS:
            return None
        bx, ty = sch.split(_fused(sch, loops[:n_s]), factors=[None, self.ROWS])
        sch.bind(bx, "blockIdx.x")
        sch.bind(ty, "threadIdx.y")
        _, tx = sch.split(_fused(sch, loops[n_s:]), factors=[None, 32])
        sch.bind(tx, "threadIdx.x")
        return sch


class VectorizedElementwise(_Rule):
    """All-spatial single block: [blocks, 128 threads, vector of 4 or 2 elements]."""

    THREADS = 128

    def apply(self, func, target, _tunable):
        if "bool" in func.script():  # a comparison in the body: CUDA has no vector of bools
            return None
        got = _one_block(func, lambda kinds: set(kinds) == {"S"})
        if got is None:
            return None
        sch, loops, _ = got
        total = _extent(sch, loops)
        vec = next((v for v in (4, 2) if total and total % v == 0 and total >= v * self.THREADS), 0)
        if not vec:
            return None
        bx, tx, vx = sch.split(_fused(sch, loops), factors=[None, self.THREADS, vec])
        sch.bind(bx, "blockIdx.x")
        sch.bind(tx, "threadIdx.x")
        sch.vectorize(vx)
        return sch
