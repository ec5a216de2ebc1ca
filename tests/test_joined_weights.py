"""A bf16 frozen weight held joined with its LoRA B columns on CUDA (compiler/passes/gemm_lora_k.py):
what the manifest says of it, how the runtime uploads it, and how cuBLAS reads it. The pass itself
and its kernel: tests/test_compiler_gpu_passes.py; the step's numerics on the GPU:
bench/h200_quant_check.py (`dense`) and bench/h200_check.py."""
from __future__ import annotations

import types

import numpy as np
import pytest

from _compiler_graphs import SMALL_QWEN3
from lorac.graphs import ALL_TARGETS, ModelSpec, TrainSpec, build_training_graph


def test_manifest_names_the_joined_weights_own_width():
    """gate and up of a bf16 base (intermediate = 2 x hidden) are inputs of [256, 128 + 2 x 4] with
    `columns` 128; every other input keeps its shape and says nothing of columns."""
    from lorac.compiler.pipeline import _signature, lower_to_relax
    from lorac.compiler.targets import cuda as target_cuda
    spec = ModelSpec.from_hf_config({**SMALL_QWEN3, "num_hidden_layers": 2, "hidden_size": 128,
                                     "intermediate_size": 256, "head_dim": 32})
    graph = build_training_graph(spec, TrainSpec(batch=2, seq=32, rank=4, lora_targets=tuple(ALL_TARGETS)))
    mod, _, _, gemm = lower_to_relax(graph, target_cuda, "bfloat16")
    inputs, _ = _signature(graph, mod["main"], gemm["lora_k_resident"])
    joined = {i["name"]: (i["shape"], i["columns"]) for i in inputs if "columns" in i}
    assert joined == {f"model.layers.{n}.mlp.{p}_proj.weight": ([256, 136], 128) for n in (0, 1) for p in ("gate", "up")}
    down = next(i for i in inputs if i["name"] == "model.layers.0.mlp.down_proj.weight")
    assert down["shape"] == [128, 256]


def test_upload_pads_a_joined_weight_with_zeros():
    """The runtime takes the model's own [out, in] weight for an input of [out, in + n r] with `columns`
    in, and adds zero columns (the slots its LoRA B columns are written into); any other width is
    refused as before."""
    from lorac.runtime.engine.artifact import Step
    from lorac.runtime.errors import LoracError
    spec = {"name": "w", "shape": [3, 7], "dtype": "float32", "columns": 5}
    fake = types.SimpleNamespace(_vocab=None)
    w = np.arange(15, dtype=np.float32).reshape(3, 5)
    got = Step.checked(fake, spec, w)
    assert got.shape == (3, 7) and got.flags.c_contiguous
    np.testing.assert_array_equal(got[:, :5], w)
    assert not got[:, 5:].any()
    assert Step.checked(fake, spec, np.ones((3, 7), np.float32)).shape == (3, 7)  # already joined: as it is
    with pytest.raises(LoracError, match=r"input w: shape \[3, 6\]"):
        Step.checked(fake, spec, np.ones((3, 6), np.float32))


def test_cublas_reads_a_wider_right_operand_by_its_row_length():
    """cuBLAS's arguments (runtime/devices/cuda/cublas._plan, no GPU needed): every operand's leading
    dimension is its own row length, which equals the former rule for exact shapes, and lets dY W read
    the first `in` columns of a joined [out, in + n r] weight."""
    from lorac.runtime.devices.cuda.cublas import _plan
    bf = "bfloat16"
    for ta, tb, sa, sb, so in [(False, False, (64, 256), (256, 128), (64, 128)),
                               (False, True, (64, 128), (256, 128), (64, 256)),
                               (True, False, (256, 64), (256, 128), (64, 128)),
                               (False, False, (4, 64, 32), (4, 32, 16), (4, 64, 16)),
                               (False, True, (2, 8, 32), (32, 32), (2, 8, 32))]:
        opb, opa, n, m, k, _, ldb, sb_, _, lda, sa_, _, ldc, _, batch = _plan(ta, tb, sa, sb, so, bf, bf, bf)
        M, N = so[-2], so[-1]
        K = sa[-2] if ta else sa[-1]
        assert (ldb, lda, ldc) == ((K if tb else N), (M if ta else K), N)
    # dY [64, 256] x W_joined [256, 136] -> dX [64, 128]: m = 128 columns of W read with ld = 136
    opb, opa, n, m, k, _, ldb, _, _, lda, _, _, ldc, _, _ = _plan(False, False, (64, 256), (256, 136), (64, 128),
                                                                  bf, bf, bf)
    assert (n, m, k, ldb, lda, ldc) == (128, 64, 256, 136, 256, 128)


def test_estimate_counts_the_joined_columns():
    """runtime/train/memory.joined_dense: at the Llama-3-8B shape, 4x2048, r=16 on all seven, gate and
    up of every layer are 2 x 16 columns wider (bf16) and the step copies x beside u once; nothing
    where they are quantized (the dequantization workspace counts those), not adapted, or in fp32."""
    from dataclasses import replace

    from lorac.graphs.ops.quant import Quant
    from lorac.runtime.train.memory import joined_dense
    spec = ModelSpec.from_hf_config(dict(model_type="llama", vocab_size=128256, hidden_size=4096,
                                         intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                                         num_key_value_heads=8, head_dim=128, tie_word_embeddings=False))
    train = TrainSpec(batch=4, seq=2048, rank=16, lora_targets=tuple(ALL_TARGETS))
    assert joined_dense(spec, train, "bfloat16") == 2 * (2 * 14336 * 32 * 32 + 4 * 2048 * (4096 + 32))
    assert joined_dense(spec, train, "float32") == 0
    assert joined_dense(spec, replace(train, lora_targets=("q_proj", "v_proj")), "bfloat16") == 0
    quant = tuple(sorted((f"model.layers.{i}.mlp.{p}.weight", Quant(kind="nf4", block=64, double=True))
                         for i in range(32) for p in ("gate_proj", "up_proj")))
    assert joined_dense(spec, replace(train, quant=quant), "bfloat16") == 0
