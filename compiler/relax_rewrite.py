"""Running a Relax expression mutator over a whole module (gemm.py, fast_math.py and
legalize_cache.py each rewrite calls with one)."""
from __future__ import annotations

import tvm
from tvm import relax


def rewrite_functions(mutator, mod: tvm.IRModule) -> tvm.IRModule:
    """Every Relax function of `mod` through `mutator` (a PyExprMutator made on `mod`)."""
    for gv, func in mod.functions_items():
        if isinstance(func, relax.Function):
            mutator.builder_.update_func(gv, mutator.visit_expr(func))
    return mutator.builder_.get()
