"""Units in the compiler (compiler/units/__init__.py): a target that does not map the attention units
inlines them, and the inlined backward shares what its forward already computed (the masked
scores, the transposed q/k/v) instead of recomputing it; the numbers do not change."""
import numpy as np
import pytest

from _compiler_graphs import SMALL_QWEN3, random_inputs
from oracles import run_ort

pytest.importorskip("tvm")


def _graph(checkpointing: bool):
    from lorac.graphs import ALL_TARGETS, ModelSpec, TrainSpec, build_training_graph
    spec = ModelSpec.from_hf_config(SMALL_QWEN3)
    return build_training_graph(spec, TrainSpec(batch=2, seq=8, rank=4, lora_targets=tuple(ALL_TARGETS),
                                                checkpointing=checkpointing))


@pytest.mark.parametrize("checkpointing", [False, True])
def test_inlined_backward_reuses_the_forward_scores(checkpointing):
    from lorac.compiler.units import split_units
    from lorac.graphs.builder import inline_units

    model = _graph(checkpointing)
    plain = inline_units(model)
    deduped, mapped = split_units(_graph(checkpointing), native={})
    assert mapped == [] and not any(n.domain == "lorac" for n in deduped.graph.node)
    count = lambda m, op: sum(n.op_type == op for n in m.graph.node)
    layers = SMALL_QWEN3["num_hidden_layers"]
    # one q k^T a layer fewer: the backward reads the forward's (with checkpointing, the
    # recomputed forward's, never the original's)
    assert count(plain, "MatMul") - count(deduped, "MatMul") == layers
    x = random_inputs(model)
    want, got = run_ort(plain, x), run_ort(deduped, x)
    for name, ref in want.items():
        np.testing.assert_allclose(got[name], ref, rtol=1e-6, atol=1e-7)
