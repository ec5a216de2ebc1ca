"""Running a Relax expression mutator over a whole module (gemm.py, gemm_sum.py,
compiler/passes/fast_math.py and compiler/passes/legalize_cache.py each rewrite calls with one), and walking its dataflow
blocks (the analyses those rewrites start from), and removing the bindings those rewrites leave unread."""
from __future__ import annotations

import tvm
from tvm import relax


def rewrite_functions(mutator, mod: tvm.IRModule) -> tvm.IRModule:
    """Every Relax function of `mod` through `mutator` (a PyExprMutator made on `mod`)."""
    for gv, func in mod.functions_items():
        if isinstance(func, relax.Function):
            mutator.builder_.update_func(gv, mutator.visit_expr(func))
    return mutator.builder_.get()


def dataflow_blocks(mod: tvm.IRModule):
    """Every dataflow block of every Relax function of `mod`."""
    for func in mod.functions.values():
        if isinstance(func, relax.Function) and isinstance(func.body, relax.SeqExpr):
            yield from (b for b in func.body.blocks if isinstance(b, relax.DataflowBlock))


def with_blocks(func: relax.Function, blocks: list) -> relax.Function:
    """`func` with its body's binding blocks replaced (its output, signature and attributes kept)."""
    return relax.Function(func.params, relax.SeqExpr(blocks, func.body.body), func.ret_ty, func.is_pure, func.attrs)


def _sweep(func: relax.Function) -> relax.Function:
    """`func` without the top-level bindings nothing reads: one walk from its output back to its
    first binding. Impure calls and match_casts stay, as TVM's RemoveAllUnused keeps them."""
    if not isinstance(func.body, relax.SeqExpr):
        return func
    free, impure = relax.analysis.free_vars, relax.analysis.contains_impure_call
    live, blocks, dropped = set(free(func.body.body)), [], 0
    for block in reversed(func.body.blocks):
        kept = []
        for b in reversed(block.bindings):
            if b.var in live or isinstance(b, relax.MatchCast) or impure(b.value):
                live.update(free(b.value))
                kept.append(b)
        dropped += len(block.bindings) - len(kept)
        blocks.append(type(block)(kept[::-1]))
    return with_blocks(func, blocks[::-1]) if dropped else func


def eliminate_dead_code(mod: tvm.IRModule) -> tvm.IRModule:
    """relax.transform.DeadCodeElimination, with the unused bindings dropped first in linear time.
    TVM's RemoveAllUnused costs (unused bindings) x (all bindings): 20.9 s on an 8B NF4 training
    graph's 6150 dead bindings of 26552, against 0.17 s for this walk; on what the walk leaves, TVM's
    pass (which also drops unused functions) takes 0.18 s."""
    swept = {gv: _sweep(f) for gv, f in mod.functions_items() if isinstance(f, relax.Function)}
    changed = {gv: f for gv, f in swept.items() if not f.same_as(mod[gv])}
    if changed:
        mod = mod.clone()  # the caller's module stays as it was
        for gv, f in changed.items():
            mod[gv] = f
    return relax.transform.DeadCodeElimination()(mod)
