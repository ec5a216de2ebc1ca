"""The step's memory plan (compiler/memory_plan.py, compiler/units/__init__.py): the arena's offsets
never overlap while two tensors live, the arena plans less than TVM's token pools with the
same results, it composes with the CUDA-graph rewrite, and GEMMs are bound where the graph
put them."""
from __future__ import annotations

import numpy as np
import pytest
from _compiler_graphs import SMALL_QWEN3, random_inputs, small_training_graph

tvm = pytest.importorskip("tvm")


def _check_offsets(size, first, last):
    from lorac.compiler.memory_plan import ALIGN, assign_offsets

    offset, total = assign_offsets(size, first, last)
    keys = list(size)
    for t in keys:
        assert offset[t] % ALIGN == 0 and offset[t] + size[t] <= total
    for i, a in enumerate(keys):
        for b in keys[i + 1:]:
            if first[a] <= last[b] and first[b] <= last[a]:  # alive together: apart in memory
                assert offset[a] + size[a] <= offset[b] or offset[b] + size[b] <= offset[a], (a, b)
    steps = range(min(first.values()), max(last.values()) + 1)
    peak = max(sum(size[t] for t in keys if first[t] <= s <= last[t]) for s in steps)
    assert peak <= total <= sum(-(-n // ALIGN) * ALIGN for n in size.values())
    return offset, total


@pytest.mark.parametrize("seed", range(6))
def test_offsets_never_overlap_while_live(seed):
    rng = np.random.default_rng(seed)
    n = 60
    first = {f"t{i}": int(rng.integers(0, 100)) for i in range(n)}
    last = {t: s + int(rng.integers(0, 30)) for t, s in first.items()}
    size = {t: int(rng.choice([1, 200, 256, 4096, 70_000, 1 << 20])) for t in first}
    _check_offsets(size, first, last)


def test_offsets_reuse_memory_across_lifetimes():
    # a chain where each tensor dies as the next is born needs two slots, not five
    size = {f"t{i}": 1024 for i in range(5)}
    first = {f"t{i}": i for i in range(5)}
    last = {f"t{i}": i + 1 for i in range(5)}
    _, total = _check_offsets(size, first, last)
    assert total == 2 * 1024


def _compile(tmp_path, name, arena: bool, monkeypatch):
    from lorac.compiler import compile_graph
    from lorac.compiler.targets import cpu as target_cpu
    from lorac.runtime.engine.artifact import load_artifact

    monkeypatch.setattr(target_cpu, "ARENA_PLAN", arena)
    monkeypatch.setenv("LORAC_ISOLATED_BUILD", "1")  # build in this process, with the patched target
    model = small_training_graph(seq=12)
    art = compile_graph(model, target="cpu", out_dir=tmp_path / name, force=True)
    step = load_artifact(art, "cpu")
    return step.manifest.static_plan_bytes, step(random_inputs(model))


def test_arena_plans_less_with_identical_results(tmp_path, monkeypatch):
    tvm_plan, ref = _compile(tmp_path, "tokens", False, monkeypatch)
    arena_plan, out = _compile(tmp_path, "arena", True, monkeypatch)
    assert 0 < arena_plan < tvm_plan
    assert ref.keys() == out.keys()
    for k in ref:
        np.testing.assert_array_equal(out[k], ref[k], err_msg=k)  # same kernels on other addresses


def _cuda_mod(arena: bool):
    """The CUDA Relax passes (no codegen, no GPU) of a bf16 checkpointed step with CUDA graphs."""
    from lorac.compiler.targets import cuda as target_cuda
    from lorac.compiler.pipeline import bind_all_inputs, build_passes, lower_to_relax
    from lorac.compiler.targets.cuda import pass_config, relax_passes, tvm_target
    from lorac.graphs import ALL_TARGETS, ModelSpec, TrainSpec, build_training_graph

    spec = ModelSpec.from_hf_config({**SMALL_QWEN3, "num_hidden_layers": 3})
    model = build_training_graph(spec, TrainSpec(batch=2, seq=32, rank=4, lora_targets=tuple(ALL_TARGETS),
                                                 checkpointing=True, keep_layers=1))
    mod, _, _, _ = lower_to_relax(model, target_cuda, "bfloat16")
    request = {"kind": "cuda", "cuda_graph": True}
    plan: dict = {}
    with tvm_target(request), tvm.transform.PassContext(opt_level=3, config=pass_config(request)):
        mod = tvm.transform.Sequential(build_passes(relax_passes(tvm_target(request)), plan, arena=arena))(
            bind_all_inputs(mod))
    return mod, plan["static_plan_bytes"]


def test_arena_composes_with_cuda_graphs():
    from tvm import relax

    def captured(mod):
        return sorted(gv.name_hint for gv, f in mod.functions_items()
                      if isinstance(f, relax.Function) and "cuda_graph" in gv.name_hint)

    tokens, tvm_plan = _cuda_mod(False)
    arena, arena_plan = _cuda_mod(True)
    assert arena_plan < tvm_plan
    assert captured(arena) == captured(tokens) and captured(arena)  # the same capture regions
    # tensors at offsets reach kernels as views (inside the captured regions, or in main)
    assert any("ensure_zero_offset" in f.script() for _, f in arena.functions_items() if isinstance(f, relax.Function))


def test_gemms_are_bound_where_the_graph_puts_them():
    # the loss chunks' dh = dlogits E GEMMs (E the tied embedding) each right after their
    # chunk's logits GEMM, not all at the Concat that joins them (which kept every chunk's
    # dlogits alive together)
    from lorac.compiler.targets import cpu as target_cpu
    from lorac.compiler.pipeline import import_onnx
    from lorac.graphs import ModelSpec, TrainSpec, build_training_graph
    from tvm import relax

    spec = ModelSpec.from_hf_config(SMALL_QWEN3)
    model = build_training_graph(spec, TrainSpec(batch=2, seq=8, rank=4, lora_targets=("q_proj",), loss_chunk=4))
    mod, _, _ = import_onnx(model, target_cpu, "float32")
    bindings = [b for blk in mod["main"].body.blocks for b in blk.bindings]
    defs = {b.var: b.value for b in bindings}

    def reads_embed(e):
        if isinstance(e, relax.Var) and e in defs:
            e = defs[e]
        if isinstance(e, relax.Call) and getattr(e.op, "name", "") == "relax.permute_dims":
            return reads_embed(e.args[0]) and "t"
        return "n" if isinstance(e, relax.Var) and e.name == "model_embed_tokens_weight" else ""

    kinds = [reads_embed(b.value.args[1]) for b in bindings
             if isinstance(b.value, relax.Call) and getattr(b.value.op, "name", "") == "relax.matmul"]
    kinds = [k for k in kinds if k]
    assert kinds == ["t", "n"] * 4  # 16 tokens in chunks of 4: logits, then dh, per chunk


def test_memory_summary_adds_plan_weights_and_state():
    from lorac.core.manifest import Manifest
    from lorac.runtime.engine.tvm import memory_summary

    manifest = {"memory": {"static_plan_bytes": 3_000_000_000},
                "inputs": [{"name": "input_ids", "shape": [2, 8], "dtype": "int64"},
                           {"name": "model.embed_tokens.weight", "shape": [1000, 500], "dtype": "bfloat16"},
                           {"name": "model.norm.weight", "shape": [500], "dtype": "float32"},
                           {"name": "lora_A.param", "shape": [4096], "dtype": "float32"}]}
    line = memory_summary(Manifest.from_json(manifest), {"x.lora_A.weight": (4, 1000), "x.lora_B.weight": (1000, 4)}, "cuda")
    # weights 1000*500*2 + 500*4 bytes; state 4 arrays of 8000 fp32; the LoRA input is not a weight
    assert "activations and workspace 3.0 GB" in line and "frozen weights 0.0 GB" in line
    assert "total 3.0 GB" in line and line.startswith("cuda memory for training")
    big = dict(manifest, inputs=[{"name": "lm_head.weight", "shape": [128256, 4096], "dtype": "bfloat16"}])
    assert "frozen weights 1.1 GB" in memory_summary(Manifest.from_json(big), {}, "cuda")


def _synthetic():
    """A planned function as StaticPlanBlockMemory leaves one: `a` is read after its last
    direct use through a view, `c` reuses `a`'s storage token while the view still reads it
    (as TVM could never do, but the arena must not either), and `c` is returned."""
    from tvm.script import ir as I
    from tvm.script import relax as R

    @I.ir_module
    class Module:
        @R.function(pure=False)
        def main(x: R.Tensor((4,), "float32")):
            s0 = R.memory.alloc_storage(R.shape([16]), 0, "global", "float32")
            a = R.memory.alloc_tensor(s0, 0, R.shape([4]), "float32")
            _0 = R.call_packed("test.fill", x, a, sinfo_args=R.Object)
            v = R.reshape(a, R.shape([2, 2]))
            s1 = R.memory.alloc_storage(R.shape([16]), 0, "global", "float32")
            b = R.memory.alloc_tensor(s1, 0, R.shape([4]), "float32")
            _1 = R.call_packed("test.fill", x, b, sinfo_args=R.Object)
            c = R.memory.alloc_tensor(s0, 0, R.shape([4]), "float32")
            _2 = R.call_packed("test.use", v, b, c, sinfo_args=R.Object)
            return c
    return Module


def test_lifetimes_follow_views_and_the_result():
    from lorac.compiler.memory_plan import arena_plan, lifetimes
    from tvm import relax

    func = _synthetic()["main"]
    bindings = [b for blk in func.body.blocks for b in blk.bindings]
    size, first, last = lifetimes(bindings, func.body.body)
    span = {v.name: (first[v], last[v]) for v in size}
    use = next(i for i, b in enumerate(bindings) if "test.use" in str(b.value))
    assert span["a"][1] == use  # read through the view v
    assert span["c"][1] == len(bindings)  # returned
    assert all(n == 16 for n in size.values())
    planned = arena_plan(func)
    text = planned.script()
    assert text.count("alloc_storage") == 1 and text.count("ensure_zero_offset") == 2  # a, b, c in three places
    storages = []
    relax.analysis.post_order_visit(planned, lambda e: isinstance(e, relax.Call) and getattr(e.op, "name", "") ==
                                    "relax.memory.alloc_storage" and storages.append(int(e.args[0].values[0])))
    assert storages == [3 * 256]
