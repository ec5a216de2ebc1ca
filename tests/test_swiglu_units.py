"""SwiGLU's backward units (graphs/ops/mlp.py, compiler/units/swiglu.py): the kernel's math against
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
def test_kernel_math_matches_the_graph_formulas(with_act):
    """The unit's kernel (its serial CPU form, fp32) writes over its inputs, each element's
    inputs read before any result is stored: dgate = da up silu'(gate) into da, dup = da
    silu(gate) into up, act = silu(gate) up into gate (else gate is left as it was)."""
    from lorac.compiler.units.swiglu import kernel

    n = 37
    rng = np.random.default_rng(0)
    da, gate, up = (rng.standard_normal(n).astype(np.float32) * 2 for _ in range(3))
    lib = tvm.compile(tvm.IRModule({"main": kernel(n, "float32", with_act, gpu=False).with_attr("global_symbol", "main")}),
                      target="llvm")
    dev = tvm.cpu()
    bufs = [tvm.runtime.tensor(x, dev) for x in (da, gate, up)]
    lib["main"](*bufs)
    sg = _sigmoid(gate.astype(np.float64))
    want = [da * up * sg * (1 + gate * (1 - sg)), gate * sg * up if with_act else gate, da * gate * sg]
    for got, w in zip(bufs, want):
        np.testing.assert_allclose(got.numpy(), w, rtol=1e-5, atol=1e-6)


def test_cuda_kernel_vectorizes_when_the_block_divides():
    from lorac.compiler.units.swiglu import THREADS, kernel

    assert "T.vectorized(4)" in kernel(4 * THREADS * 3, "bfloat16", True).script()
    odd = kernel(4 * THREADS * 3 + 1, "bfloat16", True).script()
    assert "T.vectorized" not in odd.replace("T.vectorized(1)", "") and "if " in odd


@pytest.mark.parametrize("ckpt", [False, True])
def test_bf16_cuda_build_has_one_swiglu_backward_kernel_per_layer(ckpt):
    """bf16 CUDA: each layer's SwiGLU backward is one in-place call of the unit's kernel
    (with checkpointing its lean layers form silu(gate) * up there too), and the backward
    has no other kernel computing a sigmoid; elsewhere (fp32) the unit inlines."""
    from tvm import relax

    from lorac.compiler.targets import cuda as target_cuda
    from lorac.compiler.pipeline import lower_to_relax

    layers = 3
    spec = ModelSpec.from_hf_config({**SMALL_QWEN3, "num_hidden_layers": layers})
    model = build_training_graph(spec, TrainSpec(batch=2, seq=12, rank=4, lora_targets=tuple(ALL_TARGETS),
                                                 checkpointing=ckpt))
    mod, units, _, _ = lower_to_relax(model, target_cuda, "bfloat16")
    assert ("SwiGLUGradAct" if ckpt else "SwiGLUGrad") in units
    calls = []
    inplace = tvm.ir.Op.get("relax.call_tir_inplace")
    relax.analysis.post_order_visit(mod["main"], lambda e: calls.append(e) if isinstance(e, relax.Call) and e.op == inplace else None)
    swiglu = [c for c in calls if "swiglu" in c.args[0].name_hint]
    assert len(swiglu) == layers
    assert all(list(c.attrs.inplace_indices) == [0, 1, 2] for c in swiglu)
    # the only other sigmoids: the forward's silu(gate) * up, one a layer; a recomputed layer
    # forms it in the unit alone (its down_proj u = s act A^T too: decoder.recomputed_mlp_tail)
    sigmoids = mod["main"].script().count("R.sigmoid(")
    assert sigmoids == layers
    _, units32, _, _ = lower_to_relax(model, target_cuda, "float32")
    assert not any(u.startswith("SwiGLU") for u in units32)


PHI3 = dict(model_type="phi3", vocab_size=53, hidden_size=36, num_hidden_layers=3, num_attention_heads=6,
            num_key_value_heads=2, intermediate_size=37, tie_word_embeddings=False, pad_token_id=0, eos_token_id=1)
MAMBA = dict(model_type="mamba", vocab_size=40, hidden_size=24, state_size=4, num_hidden_layers=3, expand=2,
             conv_kernel=4, tie_word_embeddings=True)


@pytest.mark.parametrize("config,ckpt,keep", [({**SMALL_QWEN3, "num_hidden_layers": 3}, False, 0),
                                               ({**SMALL_QWEN3, "num_hidden_layers": 3}, True, 0),
                                               ({**SMALL_QWEN3, "num_hidden_layers": 3}, True, 2),
                                               (PHI3, True, 1), (PHI3, False, 0), (MAMBA, True, 0), (MAMBA, False, 0)],
                         ids=["qwen3", "qwen3-ckpt", "qwen3-keep2", "phi3-keep1", "phi3", "mamba-ckpt", "mamba"])
def test_nothing_reads_what_the_in_place_kernel_overwrites(config, ckpt, keep):
    """The unit's kernel writes over da, gate and up: in every family's bf16 CUDA step no
    binding after the call reads them (or a view of them) other than through its results."""
    from tvm import relax

    from lorac.compiler.targets import cuda as target_cuda
    from lorac.compiler.pipeline import lower_to_relax
    from lorac.compiler.passes.rewrite import dataflow_blocks
    from lorac.graphs.families import for_spec

    spec = ModelSpec.from_hf_config(config)
    extra = {"scan_chunk": 4} if config is MAMBA else {}
    train = TrainSpec(batch=2, seq=12, rank=4, lora_targets=for_spec(spec).TARGETS, checkpointing=ckpt,
                      keep_layers=keep, extra=extra)
    mod, _, _, _ = lower_to_relax(build_training_graph(spec, train), target_cuda, "bfloat16")
    inplace = tvm.ir.Op.get("relax.call_tir_inplace")
    views = (tvm.ir.Op.get("relax.reshape"),)
    checked = 0
    for block in dataflow_blocks(mod):
        bindings = list(block.bindings)
        alias = {}  # var -> the root tensor it views
        for b in bindings:
            v = b.value
            if isinstance(v, relax.Call) and v.op in views and isinstance(v.args[0], relax.Var):
                alias[b.var] = alias.get(v.args[0], v.args[0])
        root = lambda x: alias.get(x, x)
        for k, b in enumerate(bindings):
            v = b.value
            if not (isinstance(v, relax.Call) and v.op == inplace and "swiglu" in v.args[0].name_hint):
                continue
            overwritten = {root(a) for a in v.args[1].fields}
            for later in bindings[k + 1:]:
                used = {root(x) for x in relax.analysis.free_vars(later.value)} if not isinstance(later.value, relax.Var) else {root(later.value)}
                assert not (used & overwritten), str(later.value)[:200]
            checked += 1
    assert checked == spec.layers
