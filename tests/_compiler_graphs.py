"""Shared by the compiler tests: a small real lorac training graph and inputs for it."""
from __future__ import annotations

import numpy as np
import onnx

SMALL_QWEN3 = {"model_type": "qwen3", "vocab_size": 96, "hidden_size": 32, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
               "intermediate_size": 48, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
               "tie_word_embeddings": True}


def small_training_graph(batch=2, seq=8, rank=4) -> onnx.ModelProto:
    from lorac.graphs import ALL_TARGETS, ModelSpec, TrainSpec, build_training_graph

    spec = ModelSpec.from_hf_config(SMALL_QWEN3)
    return build_training_graph(spec, TrainSpec(batch=batch, seq=seq, rank=rank, lora_targets=tuple(ALL_TARGETS)))


def nf4_layers(spec) -> tuple:
    """A TrainSpec's `quant` with every projection of `spec` in NF4 with a double-quantized absmax
    (what --quantize nf4 and the bnb-4bit checkpoints hold)."""
    from lorac.graphs.families import for_spec
    from lorac.graphs.ops.quant import Quant

    fam = for_spec(spec)
    return tuple(sorted((fam.weight_name(i, t), Quant("nf4", 64, True)) for i in range(spec.layers) for t in fam.TARGETS))


def random_inputs(model: onnx.ModelProto, seed: int = 0, vocab: int | None = None, rng=None,
                  ignored: int = 1) -> dict[str, np.ndarray]:
    """Values for every graph input: ids/labels in [0, vocab) (the first `ignored` labels of row 0
    ignored), weights ~N(0, 0.1^2), norm weights near 1, LoRA B small but non-zero so every
    gradient is. `vocab` defaults to the dense embedding input's rows; `rng` to one seeded by `seed`."""
    rng = rng if rng is not None else np.random.default_rng(seed)
    inits = {i.name for i in model.graph.initializer}
    ins = [i for i in model.graph.input if i.name not in inits]
    if vocab is None:
        vocab = next(d.type.tensor_type.shape.dim[0].dim_value for d in ins if d.name.endswith("embed_tokens.weight"))
    out = {}
    for i in ins:
        shape = [d.dim_value for d in i.type.tensor_type.shape.dim]
        if i.type.tensor_type.elem_type == onnx.TensorProto.INT64:
            out[i.name] = rng.integers(0, vocab, size=shape, dtype=np.int64)
        elif "norm" in i.name:
            out[i.name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            out[i.name] = (0.1 * rng.standard_normal(shape)).astype(np.float32)
    out["labels"][0, :ignored] = -100
    return out


def saved_training_graph(folder) -> tuple:
    """(path, model): small_training_graph() written to folder/train.onnx."""
    model = small_training_graph()
    path = folder / "train.onnx"
    onnx.save(model, str(path))
    return path, model


def assert_outputs_close(got: dict, want: dict, rel: float) -> None:
    """Same output names, and each output's max abs difference <= rel x its max abs value."""
    assert set(got) == set(want)
    for name, ref in want.items():
        err = np.abs(got[name] - ref).max() / max(np.abs(ref).max(), 1e-30)
        assert err <= rel, f"{name}: relative error {err:.2e} > {rel:.0e}"


def count_matmuls(model: onnx.ModelProto, units_inlined: bool = True) -> int:
    """MatMul nodes the build sees: the graph's own, plus, when the build inlines the units
    (every target but CUDA bf16, which maps them to cuDNN), those of the inlined bodies
    after the backward's reuse of its forward (compiler/units/__init__.py)."""
    if units_inlined:
        from lorac.compiler.units import split_units
        model, _ = split_units(model, native={})
    return sum(node.op_type == "MatMul" for node in model.graph.node)


def cuda_plan(model, dtype: str, cuda_graph: bool = False) -> dict:
    """Run compile_graph's CUDA Relax passes (import, bf16, GEMM dispatch, legalize, DLight,
    memory plan and its arena, CUDA graphs if asked) without codegen; -> the recorded plan. Raises if a
    kernel is left unscheduled."""
    import tvm
    from lorac.compiler.targets import cuda as target_cuda
    from lorac.compiler.pipeline import bind_all_inputs, build_passes, lower_to_relax
    from lorac.compiler.targets.cuda import pass_config, relax_passes, tvm_target

    mod, _, _, _ = lower_to_relax(model, target_cuda, dtype)
    request = {"kind": "cuda", "cuda_graph": cuda_graph}
    if cuda_graph:
        mod = bind_all_inputs(mod)
    plan: dict = {}
    target = tvm_target(request)
    with target, tvm.transform.PassContext(opt_level=3, config=pass_config(request)):
        mod = tvm.transform.Sequential(build_passes(relax_passes(target), plan, arena=target_cuda.ARENA_PLAN))(mod)
    unscheduled = [gv.name_hint for gv, f in mod.functions_items()
                   if isinstance(f, tvm.tirx.PrimFunc) and not f.attrs.get("tirx.is_scheduled", False)]
    assert not unscheduled, unscheduled
    plan["_mod"] = mod
    return plan
