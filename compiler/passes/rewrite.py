"""Running a Relax expression mutator over a whole module (gemm.py, gemm_sum.py,
compiler/passes/fast_math.py and compiler/passes/legalize_cache.py each rewrite calls with one), and walking its dataflow
blocks (the analyses those rewrites start from)."""
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
