"""The GPU Relax pipeline on its own (no nvcc, no GPU): every kernel of the decoder and Mamba
training graphs gets a DLight schedule in fp32 and bf16, and the bf16 rewrite keeps a checkpointed layer's recomputed forward (it once merged it away)."""
from __future__ import annotations

import re

import pytest
from _compiler_graphs import SMALL_QWEN3, nf4_layers
from _compiler_graphs import cuda_plan as _cuda_plan
from lorac.graphs import ALL_TARGETS, ModelSpec, TrainSpec, build_training_graph
from lorac.graphs.mamba_spec import MAMBA_TARGETS

tvm = pytest.importorskip("tvm")

SMALL_MAMBA = dict(model_type="mamba", vocab_size=40, hidden_size=24, state_size=4, num_hidden_layers=3, expand=2,
                   conv_kernel=4, tie_word_embeddings=True)


def _decoder(ckpt: bool):
    spec = ModelSpec.from_hf_config({**SMALL_QWEN3, "num_hidden_layers": 4})
    return build_training_graph(spec, TrainSpec(batch=2, seq=64, rank=4, lora_targets=tuple(ALL_TARGETS),
                                                checkpointing=ckpt))


def _mamba(ckpt: bool):
    spec = ModelSpec.from_hf_config(SMALL_MAMBA)
    return build_training_graph(spec, TrainSpec(batch=2, seq=21, rank=3, alpha=6, lora_targets=MAMBA_TARGETS,
                                                checkpointing=ckpt, extra={"scan_chunk": 4}))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mamba_schedules_on_gpu(dtype):
    # fp32 used to stop in DLight's Reduction rule (an assertion on the scan's contraction)
    assert _cuda_plan(_mamba(False), dtype)["static_plan_bytes"] > 0


def _op_counts(mod) -> dict[str, int]:
    from collections import Counter

    from tvm import relax
    counts = Counter()
    relax.analysis.post_order_visit(mod["main"], lambda e: isinstance(e, relax.Call) and isinstance(
        e.op, tvm.ir.Op) and e.op.name != "relax.astype" and counts.update([e.op.name]))
    return counts


@pytest.mark.parametrize("make", [_decoder, _mamba], ids=["decoder", "mamba"])
def test_bf16_keeps_recomputed_layers(make):
    # bf16 mode once merged common subexpressions, which folded each checkpointed layer's
    # recomputed forward back onto the original and kept every activation alive until the
    # backward (the 24-layer Mamba-130M plan at 8x1024 grew by 8 GB a layer and did not fit)
    from lorac.compiler.targets import cpu as target_cpu
    from lorac.compiler.pipeline import import_onnx
    from lorac.compiler.passes.precision import frozen_weights_to_bf16

    mod, _, _ = import_onnx(make(True), target_cpu, "float32")  # attention inlined, the scan its kernels
    before = _op_counts(mod)
    assert _op_counts(frozen_weights_to_bf16(mod)) == before


def test_reductions_get_threads_by_row_length():
    # DLight 0.27 declines `max`: the loss's row max over the vocabulary fell to Fallback (one
    # thread per row, 79 ms of a Qwen3-0.6B step). RowReduction spreads a long row (> 4096)
    # over 256 threads; the norms' sums over 8..4096 elements get one warp per row.
    spec = ModelSpec.from_hf_config({**SMALL_QWEN3, "vocab_size": 8192, "hidden_size": 64})
    model = build_training_graph(spec, TrainSpec(batch=2, seq=8, rank=4, lora_targets=tuple(ALL_TARGETS)))
    mod = _cuda_plan(model, "bfloat16")["_mod"]
    funcs = {gv.name_hint: f.script() for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)}
    row_max = [n for n in funcs if re.fullmatch(r"(fused_cast\d*_)?max\d*", n)]  # the logits' widening fused in
    assert row_max and all('T.thread_binding(T.int64(256), thread="threadIdx.x")' in funcs[n] for n in row_max)
    # the norms' sums of squares (and of gw * xhat), each with its product fused in: rows
    # of 64 (hidden) get a warp per row, 8 rows a block; none gets 256 threads
    short = [n for n in funcs if re.fullmatch(r"fused_((cast|multiply)\d*_)*multiply\d*_sum\d*", n)]
    warp = [n for n in short if 'T.thread_binding(T.int64(32), thread="threadIdx.x")' in funcs[n]
            and 'T.thread_binding(T.int64(8), thread="threadIdx.y")' in funcs[n]]
    assert len(warp) >= 2
    assert not any('T.thread_binding(T.int64(256), thread="threadIdx.x")' in funcs[n] for n in short)


def test_elementwise_kernels_are_vectorized():
    """Elementwise kernels over bf16 activations (SwiGLU, casts, residual adds) read and write
    4 elements a thread as one vector; kernels with a comparison keep DLight's Fallback."""
    mod = _cuda_plan(_decoder(False), "bfloat16")["_mod"]
    funcs = {gv.name_hint: f.script() for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)}
    swiglu = [n for n in funcs if "sigmoid" in n]  # the forward's silu(gate) * up
    assert swiglu and all("T.vectorized(T.int64(4))" in funcs[n] for n in swiglu)
    grad = [n for n in funcs if "swiglu_grad" in n]  # the backward's unit, scheduled by lorac
    assert grad and all("T.vectorized(4)" in funcs[n] for n in grad)
    assert not any("T.vectorized" in f and "bool" in f for f in funcs.values())


def _calls(func) -> dict:
    """Counts of what a Relax function calls: GEMMs (lorac.gemm_*), kernels (PrimFuncs), graph launches."""
    from tvm import relax

    n = {"gemm": 0, "kernel": 0, "graph": 0, "attention": 0}

    def visit(e):
        if not isinstance(e, relax.Call):
            return
        if isinstance(e.op, relax.ExternFunc) and e.op.global_symbol.startswith("lorac.gemm"):
            n["gemm"] += 1
        elif isinstance(e.op, relax.ExternFunc) and e.op.global_symbol.startswith("lorac.attention"):
            n["attention"] += 1
        elif isinstance(e.op, relax.GlobalVar):
            n["kernel"] += 1
        elif isinstance(e.op, tvm.ir.Op) and e.op.name == "relax.call_builtin_with_ctx" \
                and "cuda_graph.run_or_capture" in str(e.args[0]):
            n["graph"] += 1

    relax.analysis.post_order_visit(func, visit)
    return n


def test_cuda_graphs_capture_the_step_once_inputs_are_bound():
    """With every input bound, the step is a few CUDA graphs: what the VM still issues itself
    is the graph launches and one small kernel per output that writes it (TVM keeps output
    buffers out of graphs), not the ~60 calls a layer it issued before."""
    from lorac.graphs import lora_tensor_names

    model = _decoder(False)
    mod = _cuda_plan(model, "bfloat16", cuda_graph=True)["_mod"]
    main = _calls(mod["main"])
    captured = [_calls(f) for gv, f in mod.functions_items() if gv.name_hint.startswith("main_cuda_graph_capture")]
    spec = ModelSpec.from_hf_config({**SMALL_QWEN3, "num_hidden_layers": 4})
    n_grads = len(lora_tensor_names(spec, TrainSpec(batch=2, seq=64, rank=4, lora_targets=tuple(ALL_TARGETS))))
    assert 1 <= main["graph"] <= 4 and len(captured) == main["graph"]
    # outside the graphs: one small kernel per output, writing it (compiler/units.anchor_outputs)
    assert main["gemm"] == 0 and main["kernel"] <= n_grads + 4
    assert sum(c["gemm"] for c in captured) > n_grads
    assert sum(c["kernel"] for c in captured) > 50
    # the fused attention (cuDNN) of each layer, forward and backward, is inside the graphs
    assert main["attention"] == 0 and sum(c["attention"] for c in captured) == 2 * spec.layers


def test_bf16_embedding_gathers_rows_not_the_table():
    """bf16 mode gathers the embedding rows from the bf16 table and widens only those: no fp32
    copy of the whole [vocab, hidden] table each step (622 MB for Qwen3-0.6B)."""
    main = _cuda_plan(_decoder(False), "bfloat16")["_mod"]["main"].script()
    readers = [ln.strip() for ln in main.splitlines() if re.search(r"[(,] ?model_embed_tokens_weight,", ln)
               and not ln.strip().startswith(("def ", "R.call_packed(\"vm.builtin"))]
    # the gather reads the bf16 table itself (a table this small fuses with its index arithmetic)
    assert any("take" in r.split("(")[0] for r in readers), readers
    assert not any(r.startswith(("cast", "fused_cast")) for r in readers), readers


def test_bf16_gemm_outputs_activations_in_bf16_weight_gradients_in_fp32():
    """In bf16 builds a GEMM that writes an activation (K <= max(M, N)) writes bf16 and each
    reader widens it on its own (a widening shared by several readers would be a kernel
    writing an fp32 copy); the LoRA weight gradients, summed over every token, stay fp32."""
    from tvm import relax

    from lorac.compiler.targets import cuda as target_cuda
    from lorac.compiler.passes.gemm_output import gemm_dims
    from lorac.compiler.pipeline import lower_to_relax
    from lorac.compiler.passes.rewrite import dataflow_blocks

    mod, _, _, gemm = lower_to_relax(_decoder(False), target_cuda, "bfloat16")
    seen = {"bfloat16": 0, "float32": 0}
    for block in dataflow_blocks(mod):
        values = {b.var: b.value for b in block.bindings}
        users = relax.analysis.udchain(block)
        for var, value in values.items():
            if not (isinstance(value, relax.Call) and isinstance(value.ty, relax.TensorType)):
                continue
            if value.op == tvm.ir.Op.get("relax.call_dps_packed") and value.args[0].global_symbol.startswith("lorac.gemm"):
                m, n, k = gemm_dims(value.args[0].global_symbol, list(value.args[1].fields))
                dtype = str(value.ty.dtype)
                assert dtype == ("float32" if k > max(m, n) else "bfloat16"), (m, n, k, dtype)
                seen[dtype] += 1
            elif value.op == tvm.ir.Op.get("relax.astype") and str(value.ty.dtype) == "float32":
                src = values.get(value.args[0])
                if isinstance(src, relax.Call) and "lorac.gemm" in str(src.args[0]):
                    assert len(users[var]) == 1
    # every GEMM narrow_gemm_outputs made bf16 is there, but those the LoRA joins took in (gemm_lora_k, gemm_lora_du)
    assert 0 < seen["bfloat16"] <= gemm["bf16_outputs"] and seen["float32"] > 0
    assert gemm.get("lora_k_concat") or seen["bfloat16"] == gemm["bf16_outputs"]


def test_weight_gradients_are_computed_where_the_layer_is_and_written_at_the_end():
    """TVM's ONNX frontend binds a node when a later node reads it, so the LoRA weight
    gradients (read only by the outputs) were bound after the whole backward and kept every
    layer's activations alive: with checkpointing the plan grew by several [tokens,
    intermediate] buffers a layer. Anchored, a 4-layer plan is within a small margin of a
    2-layer one (the kept layer inputs)."""
    plans = []
    for layers in (2, 4):
        spec = ModelSpec.from_hf_config({**SMALL_QWEN3, "num_hidden_layers": layers, "intermediate_size": 512})
        model = build_training_graph(spec, TrainSpec(batch=2, seq=64, rank=4, lora_targets=tuple(ALL_TARGETS),
                                                     checkpointing=True))
        plans.append(_cuda_plan(model, "bfloat16")["static_plan_bytes"])
    per_layer_input = 2 * 64 * SMALL_QWEN3["hidden_size"] * 4  # one kept fp32 [tokens, hidden] a layer
    intermediate = 2 * 64 * 512 * 2  # a bf16 [tokens, intermediate]
    assert plans[1] - plans[0] < 2 * per_layer_input + intermediate, plans


GEMMA2 = dict(model_type="gemma2", vocab_size=53, hidden_size=24, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=10, intermediate_size=37, sliding_window=4, query_pre_attn_scalar=7,
              pad_token_id=0, eos_token_id=1, bos_token_id=2)
PHI3 = dict(model_type="phi3", vocab_size=53, hidden_size=36, num_hidden_layers=2, num_attention_heads=6,
            num_key_value_heads=2, intermediate_size=37, tie_word_embeddings=False, pad_token_id=0, eos_token_id=1)


@pytest.mark.parametrize("config", [{**SMALL_QWEN3, "num_hidden_layers": 3}, GEMMA2, PHI3], ids=["qwen3", "gemma2", "phi3"])
def test_bf16_residual_stream_is_stored_in_bf16_and_the_gradient_stream_is_not(config):
    """bf16 builds of the decoder families store the residual sums in bf16 (as transformers'
    bf16 models hold their hidden states): two a layer, in the forward only (the backward's
    gradient sums stay fp32), written by a kernel that adds in fp32 and rounds once; with
    checkpointing a recomputed layer's sums round the same way as the forward's. fp32
    builds narrow nothing."""
    from tvm import relax

    from lorac.compiler.targets import cuda as target_cuda
    from lorac.compiler.pipeline import lower_to_relax
    from lorac.compiler.passes.rewrite import dataflow_blocks

    spec = ModelSpec.from_hf_config(config)
    from lorac.graphs.families import for_spec
    targets = for_spec(spec).TARGETS  # every target (phi3's are its fused matrices)
    counts = {}
    for ckpt in (False, True):
        model = build_training_graph(spec, TrainSpec(batch=2, seq=12, rank=4, lora_targets=targets,
                                                     checkpointing=ckpt))
        mod, _, _, gemm = lower_to_relax(model, target_cuda, "bfloat16")
        counts[ckpt] = gemm["bf16_residuals"]
        adds = [b for blk in dataflow_blocks(mod) for b in blk.bindings
                if isinstance(b.value, relax.Call) and b.value.op == tvm.ir.Op.get("relax.add")
                and list(b.var.ty.shape.values) == [2 * 12, spec.hidden]]
        fp32_adds = [b for b in adds if str(b.var.ty.dtype) == "float32"]
        assert fp32_adds, "the gradient stream's sums"
        assert "bf16_residuals" not in lower_to_relax(model, target_cuda, "float32")[3]
    # each layer's two sums; with checkpointing every layer's recomputed forward also forms
    # x1 = x + o (its post-attention norm's input; its output sum is dead code there)
    assert counts[False] == 2 * spec.layers, counts
    assert counts[True] == 3 * spec.layers, counts


def test_mamba_keeps_its_residual_stream_in_fp32():
    """HF Mamba keeps its residual in fp32 (residual_in_fp32): its graph says so and the bf16
    build narrows no residual sum."""
    from lorac.compiler.targets import cuda as target_cuda
    from lorac.compiler.pipeline import lower_to_relax
    from lorac.graphs.compose import RESIDUAL_KEY

    model = _mamba(False)
    assert {p.key: p.value for p in model.metadata_props} == {RESIDUAL_KEY: "float32"}
    assert "bf16_residuals" not in lower_to_relax(model, target_cuda, "bfloat16")[3]
    assert not _decoder(False).metadata_props


def test_values_read_only_in_bf16_are_stored_in_bf16():
    """The embedding rows and every fp32 value all of whose readers narrow it again (the final
    norm's output before the logits GEMMs, a LoRA projection's s x A^T) are stored in bf16:
    no fp32 [tokens, hidden] copy of them stays alive; values with an fp32 reader are not."""
    from tvm import relax

    from lorac.compiler.targets import cuda as target_cuda
    from lorac.compiler.pipeline import lower_to_relax
    from lorac.compiler.passes.rewrite import dataflow_blocks
    spec = ModelSpec.from_hf_config({**SMALL_QWEN3, "num_hidden_layers": 2})
    model = build_training_graph(spec, TrainSpec(batch=2, seq=12, rank=4, lora_targets=tuple(ALL_TARGETS)))
    mod, _, _, gemm = lower_to_relax(model, target_cuda, "bfloat16")
    assert gemm["bf16_read_narrow"] > 0
    astype = tvm.ir.Op.get("relax.astype")
    for block in dataflow_blocks(mod):
        values = {b.var: b.value for b in block.bindings}
        for var, users in relax.analysis.udchain(block).items():
            v = values.get(var)
            if isinstance(v, relax.Call) and v.op == astype and str(v.ty.dtype) == "float32" and users:
                # a widening: read by something that computes in fp32, never only narrowed again
                assert not all(isinstance(values.get(u), relax.Call) and values[u].op == astype
                               and str(values[u].ty.dtype) == "bfloat16" for u in users), str(v)
    take = [b for blk in dataflow_blocks(mod) for b in blk.bindings
            if isinstance(b.value, relax.Call) and b.value.op == tvm.ir.Op.get("relax.take")
            and str(b.var.ty.dtype) == "bfloat16" and len(b.var.ty.shape.values) == 3]
    assert take  # the embedding rows stay bf16 ...
    users = {u for blk in dataflow_blocks(mod) for var, us in relax.analysis.udchain(blk).items()
             if var.same_as(take[0].var) for u in us}
    values = {b.var: b.value for blk in dataflow_blocks(mod) for b in blk.bindings}
    assert all(values[u].op != astype for u in users)  # ... read through a bf16 reshape, not one fp32 copy


def _nf4_decoder():
    spec = ModelSpec.from_hf_config({**SMALL_QWEN3, "num_hidden_layers": 1, "hidden_size": 128, "intermediate_size": 256,
                                     "head_dim": 32})
    return build_training_graph(spec, TrainSpec(batch=2, seq=32, rank=4, lora_targets=tuple(ALL_TARGETS),
                                                checkpointing=True, quant=nf4_layers(spec)))


def test_nf4_dequantization_is_one_kernel(monkeypatch):
    """An NF4 weight's lookup into its 16 codes fuses with the bytes' read and nibble split before
    it and the absmax scale and bf16 cast after it (compiler/passes/lookups.py): one kernel reads
    the packed bytes and writes the weight, where three wrote int32 indices and fp32 values; the
    plan holds less. The double-quantized absmax (its lookup, its scale, the product and the
    offset) is computed inside that kernel too, not by small kernels before every read
    (graphs/ops/quant.py). Embedding lookups (large tables) stay kernels of their own."""
    from lorac.compiler.passes import lookups

    model = _nf4_decoder()
    plan = _cuda_plan(model, "bfloat16")
    names = [gv.name_hint for gv, f in plan["_mod"].functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    dequant = [n for n in names if re.search(r"take\d*_.*multiply", n)]
    assert dequant, names
    # the bytes' negative-index wrap dropped (lookups.unwrap_unsigned_indices): one vectorized kernel
    assert not [n for n in dequant if "less" in n or "where" in n], dequant
    assert all(re.match(r"fused_(expand_dims\d*_)?right_shift\d*_bitwise_and\d*_cast\d*_", n) for n in dequant), dequant
    assert all("T.vectorized" in plan["_mod"][n].script() for n in dequant)
    assert all(n.count("take") == 2 and "maximum" in n for n in dequant), dequant  # the codes, the nested code
    alone = [n for n in names if re.fullmatch(r"take\d*", n)]
    assert len(alone) <= 2, alone  # the embedding's lookups; every code lookup is fused
    assert not [n for n in names if re.fullmatch(r"fused_cast\d*_take\d*|fused_multiply\d*_expand_dims\d*_sum\d*", n)]
    monkeypatch.setattr(lookups, "is_small_lookup", lambda name, func: False)
    unfused = _cuda_plan(model, "bfloat16")
    assert plan["static_plan_bytes"] < unfused["static_plan_bytes"], (plan["static_plan_bytes"],
                                                                      unfused["static_plan_bytes"])


@pytest.mark.parametrize("groups", [False, True])
def test_wide_lora_projections_over_dequantized_weights_are_one_gemm(groups, monkeypatch):
    """gate and up (out = 2 x in) over NF4 weights: y = [x | u] [W | B]^T in one GEMM, at the forward
    and at the recompute, both reading one [x | u_gate | u_up] against [W | B | 0] and [W | 0 | B]
    (compiler/passes/gemm_lora_k.py); q, k and v (together wider than their input) the same over
    [x | u_q | u_k | u_v]; o_proj and down_proj (alone, not twice as wide as their input) keep the
    accumulating pair. A dense bf16 build holds the joined weights as parameters. The dequantization
    writes the joined rows itself, vectorized, and so does the copy of x beside u. q/k/v join only
    with LORA_K_GROUPS (`groups`)."""
    from lorac.compiler.pipeline import lower_to_relax
    from lorac.compiler.targets import cuda as target_cuda
    from lorac.core import constants
    monkeypatch.setattr(constants, "LORA_K_GROUPS", groups)

    def joined(model):
        mod, _, _, gemm = lower_to_relax(model, target_cuda, "bfloat16")
        return gemm.get("lora_k_concat", 0), mod["main"].script()

    n, text = joined(_nf4_decoder())
    assert n == (10 if groups else 4), n  # (q/k/v,) gate and up, forward and recompute (the one layer is recomputed)
    assert "lorac_lora_tail" not in text  # dequantized weights are joined as they are written
    # gate and up read one [x | u_gate | u_up]: two joins of x, one a forward; q/k/v one of theirs
    wide = re.findall(r'"lorac\.gemm_nt", \((\w+), \w+\), out_ty=R\.Tensor\(\(64, 256\)', text)
    assert len(wide) == 4 and all(wide.count(a) == 2 for a in wide), wide
    qkv = re.findall(r'"lorac\.gemm_nt", \((\w+), \w+\), out_ty=R\.Tensor\(\(64, (?:128|64)\)', text)
    assert len(qkv) == (6 if groups else 0) and all(qkv.count(a) == 3 for a in qkv), qkv
    # o_proj's forward and recompute, down_proj's forward (and q/k/v's forward and recompute)
    assert text.count('"lorac.gemm_acc_ntnt"') == (3 if groups else 9)
    dense_spec = ModelSpec.from_hf_config({**SMALL_QWEN3, "num_hidden_layers": 1, "hidden_size": 128,
                                           "intermediate_size": 256, "head_dim": 32})
    dense = build_training_graph(dense_spec, TrainSpec(batch=2, seq=32, rank=4, lora_targets=tuple(ALL_TARGETS),
                                                       checkpointing=True))
    n, text = joined(dense)
    assert n == (10 if groups else 4), n  # a bf16 base: gate and up held joined, [W | B | 0] and [W | 0 | B] of [256, 128 + 2 x 4]
    for proj in ("gate", "up"):
        assert f"model_layers_0_mlp_{proj}_proj_weight: R.Tensor((256, 136)" in text, text[:2000]
    for proj, rows in (("q", 128), ("k", 64), ("v", 64)):  # [W_q | B_q | 0 | 0] ... of [rows, 128 + 3 x 4]
        assert (f"model_layers_0_self_attn_{proj}_proj_weight: R.Tensor(({rows}, {140 if groups else 128})"
                in text), text[:2000]
    # B written into its slot in place at the forward and the recompute; the backward's dY W reads
    # the joined weight as it is (its first 128 columns)
    assert text.count("R.call_tir_inplace(lorac_lora_tail") == (10 if groups else 4)
    assert re.search(r'"lorac\.gemm_acc_n+", \([^)]*model_layers_0_mlp_gate_proj_weight', text)
    mod = _cuda_plan(_nf4_decoder(), "bfloat16")["_mod"]
    funcs = {gv.name_hint: f.script() for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)}
    # the joins (not RoPE's halves, nor the labels' shift)
    concat = [k for k in funcs if re.search(r"concatenate\d*_reshape\d*$", k) and "bfloat16" in funcs[k]]
    assert any("take" in k for k in concat) and any("take" not in k for k in concat), list(funcs)
    assert all("T.vectorized" in funcs[k] for k in concat), concat


@pytest.mark.parametrize("weight, joined", [("cast", 0), ("scaled", 2), ("bf16", 2), ("bf16-read-transposed", 1),
                                           ("bf16-read-otherwise", 1)])
def test_only_weights_computed_in_the_step_or_held_joined_are_joined(weight, joined):
    """compiler/passes/gemm_lora_k.py on a hand-made module: a frozen weight that is only a cast of a
    parameter keeps the accumulating pair (a join would copy it every step); one computed in the step
    (a dequantization; here a scale) is joined, and two projections of one x share its join. A bf16
    parameter read only by those projections and by dY W is held joined ([W | B | 0], the parameter
    widened, B written in place); one read any other way (transposed by another GEMM, or by an
    elementwise op) is not."""
    from tvm import relax

    from lorac.compiler.passes.gemm_lora_k import concat_lora_gemms
    T, K, N, r = 8, 16, 32, 4
    bb = relax.BlockBuilder()
    ty = lambda *shape: relax.TensorType(shape, "bfloat16")  # noqa: E731
    x, u1, u2, b1, b2, dy = (relax.Var(n, ty(*sh)) for n, sh in
                             (("x", (T, K)), ("u1", (T, r)), ("u2", (T, r)), ("b1", (N, r)), ("b2", (N, r)),
                              ("dy", (T, N))))
    wdt = "bfloat16" if weight.startswith("bf16") else "float32"
    w1, w2 = (relax.Var(n, relax.TensorType((N, K), wdt)) for n in ("w1", "w2"))
    with bb.function("main", [x, u1, u2, b1, b2, dy, w1, w2]):
        with bb.dataflow():
            ys = []
            for u, b, w in ((u1, b1, w1), (u2, b2, w2)):
                if weight == "scaled":
                    w = relax.op.multiply(w, relax.const(0.5, "float32"))
                wb = w if wdt == "bfloat16" else bb.emit(relax.op.astype(w, "bfloat16"))
                ys.append(bb.emit(relax.call_dps_packed("lorac.gemm_acc_ntnt", [u, b, x, wb], ty(T, N))))
            if wdt == "bfloat16":  # the input gradient: dY W of both
                ys.append(bb.emit(relax.call_dps_packed("lorac.gemm_acc_nnnn", [dy, w1, dy, w2], ty(T, K))))
            if weight == "bf16-read-transposed":
                ys.append(bb.emit(relax.call_dps_packed("lorac.gemm_nt", [x, w2], ty(T, N))))
            if weight == "bf16-read-otherwise":
                ys.append(bb.emit(relax.op.astype(w1, "float32")))
            out = bb.emit_output(relax.Tuple(ys))
        bb.emit_func_output(out)
    mod, n, slots = concat_lora_gemms(bb.get())
    held = {name: own[0] for name, own in slots.items()}
    text = mod["main"].script()
    if joined == 1:  # the other weight alone is held joined: its projection joins, the refused one's does not
        assert (n, sorted(held)) == (1, ["w1" if weight == "bf16-read-transposed" else "w2"]), (n, held)
        assert text.count('"lorac.gemm_acc_ntnt"') == 1 and text.count("R.call_tir_inplace") == 1
        return
    assert n == joined
    assert text.count('"lorac.gemm_acc_ntnt"') == 2 - joined
    if joined:  # one join of x for both: [T, K + 2r]
        assert text.count(f"R.Tensor(({T}, {K + 2 * r}), dtype=\"bfloat16\") = R.reshape") == 1, text
    if weight == "bf16":
        assert held == {"w1": K, "w2": K}
        assert f"w1: R.Tensor(({N}, {K + 2 * r}), dtype=\"bfloat16\")" in text
        assert text.count("R.call_tir_inplace") == 2 and '"lorac.gemm_acc_nnnn", (dy, w1, dy, w2)' in text, text
    else:
        assert held == {} and "R.call_tir_inplace" not in text


@pytest.mark.parametrize("rows, r, offset", [(7, 4, 16), (130, 16, 4096 % 97 * 4), (64, 8, 0)])
def test_lora_tail_kernel_writes_only_its_slot(rows, r, offset):
    """gemm_lora_k.tail_kernel (serial, on the CPU; the CUDA form is compiled by the GPU-pass tests and
    run by bench/h200_quant_check.py): b lands in columns [offset, offset + r) of w, in place, and no
    other element of w changes."""
    import numpy as np
    import tvm

    from lorac.compiler.passes.gemm_lora_k import tail_kernel
    width = offset + 2 * r + 8
    func = tail_kernel(rows, width, r, offset, "float32", gpu=False).with_attr("global_symbol", "tail")
    lib = tvm.compile(tvm.IRModule({"tail": func}), target="llvm")
    rng = np.random.default_rng(rows)
    w0 = rng.standard_normal((rows, width)).astype(np.float32)
    b = rng.standard_normal((rows, r)).astype(np.float32)
    w = tvm.runtime.tensor(w0, tvm.cpu())
    lib["tail"](w, tvm.runtime.tensor(b, tvm.cpu()))
    want = w0.copy()
    want[:, offset:offset + r] = b
    np.testing.assert_array_equal(w.numpy(), want)


def test_only_widened_unsigned_indices_lose_their_wrap():
    """ONNX Gather's negative-index wrap (TVM's frontend: where(i < 0, i + n, i)) goes where the
    index is an unsigned value widened to a signed type, and stays for signed indices; the
    lookups' values are unchanged."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper
    from tvm import relax
    from tvm.relax.frontend.onnx import from_onnx
    from lorac.compiler.passes.lookups import unwrap_unsigned_indices
    table = helper.make_tensor("table", TensorProto.FLOAT, [256], np.arange(256, dtype=np.float32) * 0.5)
    nodes = [helper.make_node("Cast", ["u"], ["ui"], to=TensorProto.INT32),
             helper.make_node("Gather", ["table", "ui"], ["from_u"]),
             helper.make_node("Cast", ["s"], ["si"], to=TensorProto.INT32),
             helper.make_node("Gather", ["table", "si"], ["from_s"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("u", TensorProto.UINT8, [6]),
                                           helper.make_tensor_value_info("s", TensorProto.INT8, [6])],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, [6]) for n in ("from_u", "from_s")],
                              initializer=[table])
    mod = from_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), keep_params_in_input=False)
    where = tvm.ir.Op.get("relax.where")
    count = lambda m: sum(isinstance(b.value, relax.Call) and b.value.op == where  # noqa: E731
                          for f in m.functions.values() if isinstance(f, relax.Function)
                          for blk in f.body.blocks for b in blk.bindings)
    assert count(mod) == 2
    out = unwrap_unsigned_indices(mod)
    assert count(out) == 1  # the int8 index keeps its wrap
    u, sgn = np.array([0, 1, 7, 128, 200, 255], np.uint8), np.array([0, 1, -1, -128, 127, -7], np.int8)
    run = lambda m: [x.numpy() for x in relax.VirtualMachine(tvm.compile(m, "llvm"), tvm.cpu())["main"](  # noqa: E731
        tvm.runtime.tensor(u), tvm.runtime.tensor(sgn))]
    for a, b in zip(run(mod), run(out)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(run(out)[0], u.astype(np.float32) * 0.5)


@pytest.mark.parametrize("held", [True, False])
def test_du_comes_from_the_input_gradients_columns(held):
    """compiler/passes/gemm_lora_du.py on a hand-made backward (fp32, run on the CPU with lorac's
    GEMMs): du_k = dy_k B_k as thin GEMMs and dx = du A + dy1 W1 + dy2 W2 as one accumulating call
    become one GEMM over joined rows, [dx's frozen part | du_1 | du_2], the thin GEMMs gone; dx and
    both du equal numpy's. Held: two parameters held joined ([W1 | B1 | 0], [W2 | 0 | B2], B written in
    place by the tail kernels); not held: weights computed in the step (a dequantization; a scale
    here), joined with their B where the GEMM reads them."""
    import numpy as np
    import tvm
    from tvm import relax

    from lorac.compiler.passes.gemm_lora_du import lora_du_columns
    from lorac.compiler.passes.gemm_lora_k import tail_kernel
    from lorac.runtime.engine import gemm as gemms
    T, K, N, r = 12, 20, 24, 4
    W = K + 2 * r if held else K
    f32 = lambda *shape: relax.TensorType(shape, "float32")  # noqa: E731
    dy1, dy2, w1, w2, b1, b2, a = (relax.Var(n, f32(*sh)) for n, sh in (
        ("dy1", (T, N)), ("dy2", (T, N)), ("w1", (N, W)), ("w2", (N, W)), ("b1", (N, r)), ("b2", (N, r)),
        ("a", (2 * r, K))))
    bb = relax.BlockBuilder()
    tails = [bb.add_func(tail_kernel(N, W, r, K + k * r, "float32", gpu=False), f"tail{k}") for k in (0, 1)] if held else []
    with bb.function("main", [dy1, dy2, w1, w2, b1, b2, a]):
        with bb.dataflow():
            # (in the step each tail's result is the forward's joined GEMM operand: outputs here, kept)
            written = [bb.emit(relax.call_tir_inplace(tail, [w, b], [0], f32(N, W)))
                       for tail, w, b in zip(tails, (w1, w2), (b1, b2))]
            ws = (w1, w2) if held else [bb.emit(relax.op.multiply(w, relax.const(0.5, "float32"))) for w in (w1, w2)]
            du1 = bb.emit(relax.call_dps_packed("lorac.gemm_nn", [dy1, b1], f32(T, r)))
            du2 = bb.emit(relax.call_dps_packed("lorac.gemm_nn", [dy2, b2], f32(T, r)))
            du = bb.emit(relax.op.concat([du1, du2], axis=1))
            dx = bb.emit(relax.call_dps_packed("lorac.gemm_acc_nnnnnn", [du, a, dy1, ws[0], dy2, ws[1]], f32(T, K)))
            out = bb.emit_output(relax.Tuple([dx, du1, du2, *written]))
        bb.emit_func_output(out)
    mod, n, names = lora_du_columns(bb.get(), {"w1": (K, 2, r, 0), "w2": (K, 2, r, 1)} if held else {}, dequantized=True)
    text = mod["main"].script()
    assert n == 1 and names == ["lorac.gemm_acc_nnnn"], (n, names)
    assert f'"lorac.gemm_acc_nnnn", (dy1, {"w1" if held else "lv"}' in text and f"R.Tensor(({T}, {K + 2 * r})" in text, text
    assert '"lorac.gemm_nn", (dy1, b1)' not in text and '"lorac.gemm_nn", (du' not in text
    gemms.register()
    gemms.register_accumulating(names)
    vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    rng = np.random.default_rng(3)
    vals = {v.name: rng.standard_normal([int(d) for d in v.ty.shape]).astype(np.float32)
            for v in (dy1, dy2, w1, w2, b1, b2, a)}
    if held:
        for name in ("w1", "w2"):
            vals[name][:, K:] = 0.0  # the slots as uploaded; the tails write each B into its own
    got = [x.numpy() for x in vm["main"](*[tvm.runtime.tensor(vals[v.name]) for v in (dy1, dy2, w1, w2, b1, b2, a)])]
    scale = 1.0 if held else 0.5
    want_du = [vals["dy1"] @ vals["b1"], vals["dy2"] @ vals["b2"]]
    want_dx = scale * (vals["dy1"] @ vals["w1"][:, :K] + vals["dy2"] @ vals["w2"][:, :K]) + np.concatenate(want_du, 1) @ vals["a"]
    for g, w in zip(got[:3], [want_dx, *want_du]):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_dequantized_projections_of_unequal_widths_join_in_their_slots():
    """As q/k/v over a dequantized base: three weights of 24, 8 and 8 rows (GQA), computed in the step,
    r = 4: the input gradient's GEMM reads [W_q | B_q | 0 | 0], [W_k | 0 | B_k | 0], [W_v | 0 | 0 | B_v]
    and each du is its own slot's columns; dx and every du equal numpy's (fp32, the CPU)."""
    import numpy as np
    import tvm
    from tvm import relax

    from lorac.compiler.passes.gemm_lora_du import lora_du_columns
    from lorac.runtime.engine import gemm as gemms
    T, K, r, rows = 10, 16, 4, (24, 8, 8)
    f32 = lambda *shape: relax.TensorType(shape, "float32")  # noqa: E731
    dys = [relax.Var(f"dy{i}", f32(T, n)) for i, n in enumerate(rows)]
    ws = [relax.Var(f"w{i}", f32(n, K)) for i, n in enumerate(rows)]
    bs = [relax.Var(f"b{i}", f32(n, r)) for i, n in enumerate(rows)]
    a = relax.Var("a", f32(3 * r, K))
    bb = relax.BlockBuilder()
    with bb.function("main", [*dys, *ws, *bs, a]):
        with bb.dataflow():
            deq = [bb.emit(relax.op.multiply(w, relax.const(0.5, "float32"))) for w in ws]  # "dequantized"
            dus = [bb.emit(relax.call_dps_packed("lorac.gemm_nn", [dy, b], f32(T, r))) for dy, b in zip(dys, bs)]
            du = bb.emit(relax.op.concat(dus, axis=1))
            args = [du, a] + [v for dy, w in zip(dys, deq) for v in (dy, w)]
            dx = bb.emit(relax.call_dps_packed("lorac.gemm_acc_nnnnnnnn", args, f32(T, K)))
            out = bb.emit_output(relax.Tuple([dx, *dus]))
        bb.emit_func_output(out)
    assert lora_du_columns(bb.get(), {})[1] == 0  # off by default (JOIN_DEQUANTIZED: slower on the GPU)
    mod, n, names = lora_du_columns(bb.get(), {}, dequantized=True)
    assert n == 1 and names == ["lorac.gemm_acc_nnnnnn"], (n, names)
    assert f"R.Tensor(({T}, {K + 3 * r})" in mod["main"].script()
    gemms.register()
    gemms.register_accumulating(names)
    vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    rng = np.random.default_rng(5)
    vals = [rng.standard_normal([int(d) for d in v.ty.shape]).astype(np.float32) for v in (*dys, *ws, *bs, a)]
    got = [x.numpy() for x in vm["main"](*[tvm.runtime.tensor(v) for v in vals])]
    dy, w, b, av = vals[0:3], vals[3:6], vals[6:9], vals[9]
    want_du = [dy[i] @ b[i] for i in range(3)]
    want_dx = sum(0.5 * dy[i] @ w[i] for i in range(3)) + np.concatenate(want_du, 1) @ av
    for g, want in zip(got, [want_dx, *want_du]):
        np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-5)
