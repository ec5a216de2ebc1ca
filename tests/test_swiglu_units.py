"""SwiGLU's backward units (graphs/mlp.py, compiler/swiglu_units.py): the kernel's math against
the graph's formulas, and a bf16 CUDA build reading gate/up once per layer's backward."""
from __future__ import annotations

import numpy as np
import pytest
from _compiler_graphs import SMALL_QWEN3

from lorac.graphs import ALL_TARGETS, ModelSpec, TrainSpec, build_training_graph

tvm = pytest.importorskip("tvm")


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


@pytest.mark.parametrize("with_act", [False, True])
@pytest.mark.parametrize("shape", [(5, 7), (2, 3, 11)])
def test_kernel_math_matches_the_graph_formulas(shape, with_act):
    """The unit's kernel, built for the CPU in fp32: dgate = da up silu'(gate), dup = da
    silu(gate) and act = silu(gate) up, at odd shapes (no vector width divides them)."""
    from lorac.compiler.swiglu_units import compute

    rng = np.random.default_rng(0)
    da, gate, up = (rng.standard_normal(shape).astype(np.float32) * 2 for _ in range(3))
    lib = tvm.compile(tvm.IRModule({"main": compute(shape, "float32", with_act).with_attr("global_symbol", "main")}),
                      target="llvm")
    dev = tvm.cpu()
    outs = [tvm.runtime.empty(shape, "float32", dev) for _ in range(3 if with_act else 2)]
    lib["main"](*(tvm.runtime.tensor(x, dev) for x in (da, gate, up)), *outs)
    sg = _sigmoid(gate.astype(np.float64))
    want = [da * up * sg * (1 + gate * (1 - sg)), da * gate * sg] + ([gate * sg * up] if with_act else [])
    for got, w in zip(outs, want):
        np.testing.assert_allclose(got.numpy(), w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("ckpt", [False, True])
def test_bf16_cuda_build_has_one_swiglu_backward_kernel_per_layer(ckpt):
    """bf16 CUDA: each layer's SwiGLU backward is one call of the unit's kernel (three
    results with checkpointing: its lean layers form silu(gate) * up there too), and the
    backward has no other kernel computing a sigmoid; elsewhere (fp32) the unit inlines."""
    from tvm import relax

    from lorac.compiler import target_cuda
    from lorac.compiler.pipeline import lower_to_relax

    layers = 3
    spec = ModelSpec.from_hf_config({**SMALL_QWEN3, "num_hidden_layers": layers})
    model = build_training_graph(spec, TrainSpec(batch=2, seq=12, rank=4, lora_targets=tuple(ALL_TARGETS),
                                                 checkpointing=ckpt))
    mod, units, _, _ = lower_to_relax(model, target_cuda, "bfloat16")
    assert ("SwiGLUGradAct" if ckpt else "SwiGLUGrad") in units
    calls = []
    relax.analysis.post_order_visit(mod["main"], lambda e: calls.append(e) if isinstance(e, relax.Call) and e.op == tvm.ir.Op.get("relax.call_tir") else None)
    swiglu = [c for c in calls if "swiglu" in c.args[0].name_hint]
    assert len(swiglu) == layers
    assert all(len(c.ty.fields) == (3 if ckpt else 2) for c in swiglu)
    # the only other sigmoids: the forward's silu(gate) * up, one a layer, and a recomputed
    # layer's again (its down_proj LoRA input u = s act A^T)
    sigmoids = mod["main"].script().count("R.sigmoid(")
    assert sigmoids == layers * (2 if ckpt else 1)
    _, units32, _, _ = lower_to_relax(model, target_cuda, "float32")
    assert not any(u.startswith("SwiGLU") for u in units32)
