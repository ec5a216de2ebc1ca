"""--offload-embeddings: an untied model's input embedding waits in pinned host memory and the
lookup reads it in place (runtime/devices/cuda/mapped.py). Here, without a GPU: the DLPack tensor
over memory lorac owns, the engine's path for such a table (the CPU device standing in: a host
tensor built the same way), which must train bit for bit as the table on the device does, the
memory estimate and the plan's choices and errors; on a CUDA GPU, the same equality with the table
in mapped pinned memory (marked gpu)."""
import ctypes

import numpy as np
import pytest

from _compiler_graphs import nf4_layers
from tiny_model import make_model_dir

LLAMA3_8B = dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                 num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                 tie_word_embeddings=False, max_position_embeddings=8192)
QWEN3_06B = dict(model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                 num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                 tie_word_embeddings=True, max_position_embeddings=40960)


def _host_memory(nbytes: int):
    """(pointer 64-byte aligned, the buffer keeping it alive)."""
    buf = (ctypes.c_byte * (nbytes + 64))()
    return (ctypes.addressof(buf) + 63) // 64 * 64, buf


def test_dlpack_wraps_memory_lorac_owns_and_releases_it():
    pytest.importorskip("tvm")
    import ml_dtypes

    from lorac.runtime.devices import _dlpack
    ptr, keep = _host_memory(3 * 5 * 2)
    view = np.frombuffer((ctypes.c_byte * 30).from_address(ptr), ml_dtypes.bfloat16).reshape(3, 5)
    view[...] = np.arange(15, dtype=np.float32).reshape(3, 5)
    released = []
    t = _dlpack.wrap(ptr, (1, 0), (3, 5), "bfloat16", release=released.append)
    assert (tuple(t.shape), str(t.dtype), t.data_ptr()) == ((3, 5), "bfloat16", ptr)
    np.testing.assert_array_equal(t.numpy().astype(np.float32), np.arange(15).reshape(3, 5))
    before = len(_dlpack._live)
    del t
    assert released == [ptr] and len(_dlpack._live) == before - 1
    ints = _dlpack.wrap(ptr, (1, 0), (4,), "int32")  # another dtype over the same bytes, no release
    assert str(ints.dtype) == "int32" and _dlpack.nbytes((3, 5), "float32") == 60


def _stand_in_table(made: list):
    """The CPU device's stand-in for cuda's host_table: a tensor over memory the test owns."""
    from lorac.core.dtypes import as_dtype
    from lorac.runtime.devices import _dlpack

    def host_table(shape, dtype):
        n = _dlpack.nbytes(shape, dtype)
        ptr, keep = _host_memory(n)
        made.append((ptr, keep))
        view = np.frombuffer((ctypes.c_byte * n).from_address(ptr), as_dtype(dtype)).reshape(shape)
        return _dlpack.wrap(ptr, (1, 0), shape, dtype), view
    return host_table


def _train(model_dir, cache, host: tuple, bind: bool, monkeypatch, target: str = "cpu"):
    from lorac.graphs import ModelSpec, TrainSpec
    from lorac.runtime.engine import tvm as engine
    from lorac.runtime.model.weights import load_model
    from lorac.runtime.train.optim import LoraPlusConfig, group_lrs
    from lorac.runtime.train.run import init_lora

    load = engine.load_artifact

    def load_bound(art, device):  # as a CUDA-graph build's manifest says for its training step
        step = load(art, device)
        step.bound_inputs = bind and "train-" in str(art)
        return step

    if target == "cpu":
        monkeypatch.setattr(engine, "load_artifact", load_bound)
    cfg, weights = load_model(model_dir)
    spec = ModelSpec.from_hf_config(cfg)
    train = TrainSpec(batch=2, seq=11, lora_targets=tuple(spec.targets), rank=4, alpha=8.0)
    optim = LoraPlusConfig(lr=1e-2, loraplus_ratio=16.0, total_steps=4)
    logs = []
    eng = engine.Engine(spec, train, weights, target, cache_dir=cache, optim_cfg=optim, log=logs.append,
                        host_tables=host)
    ids = np.random.default_rng(0).integers(0, spec.vocab, (2, 11)).astype(np.int64)
    zeros = {n: np.zeros(s, np.float32) for n, s in eng.shapes.items()}
    eng.set_state(init_lora(eng.shapes, np.random.default_rng(1)), zeros, dict(zeros))
    losses = []
    for t in range(1, 4):
        out = eng.step({"input_ids": ids, "labels": ids}, eng.lora)
        losses.append(out.pop("loss"))
        losses.append(float(np.abs(out[sorted(out)[0]].numpy()).sum()))  # a gradient bucket's sum too
        eng.update(out, *group_lrs(t, optim), t)
    return eng, losses + [eng.eval_loss({"input_ids": ids, "labels": ids}, eng.lora)], logs


@pytest.mark.parametrize("bind", [False, True])
def test_a_table_in_host_memory_trains_as_the_device_copy(tmp_path, monkeypatch, bind):
    pytest.importorskip("tvm")
    from lorac.runtime import devices
    model_dir = make_model_dir(tmp_path / "model", arch="llama", tie_word_embeddings=False)
    _, plain, _ = _train(model_dir, tmp_path / "cache", (), bind, monkeypatch)
    made = []
    monkeypatch.setattr(devices.get("cpu"), "host_table", _stand_in_table(made))
    eng, held, logs = _train(model_dir, tmp_path / "cache", ("model.embed_tokens.weight",), bind, monkeypatch)
    assert held == plain  # bit for bit: the same kernels read the same bytes
    table = eng._weights["model.embed_tokens.weight"]
    assert len(made) == 1 and table.data_ptr() == made[0][0]  # the one host copy, read in place by every graph
    if bind:
        assert eng._artifact("train")._buffers["model.embed_tokens.weight"] is table
    line = next(m for m in logs if m.startswith("cpu memory for training"))
    assert "of embeddings in host memory" in line


@pytest.mark.gpu
def test_a_table_in_mapped_host_memory_trains_as_the_device_copy_on_the_gpu(tmp_path, monkeypatch):
    """The CUDA-graph step reading the input embedding from pinned host memory: the losses and
    gradients of three steps (graph replays) equal the step's with the table on the GPU, bit for bit."""
    pytest.importorskip("tvm")
    model_dir = make_model_dir(tmp_path / "model", arch="llama", tie_word_embeddings=False)
    _, plain, _ = _train(model_dir, tmp_path / "cache", (), True, monkeypatch, "cuda")
    eng, held, logs = _train(model_dir, tmp_path / "cache", ("model.embed_tokens.weight",), True, monkeypatch, "cuda")
    assert held == plain
    assert eng._weights["model.embed_tokens.weight"].device.dlpack_device_type() == 2  # a CUDA tensor


def test_a_device_without_host_tables_refuses_them(tmp_path):
    pytest.importorskip("tvm")
    from lorac.graphs import ModelSpec, TrainSpec
    from lorac.runtime.engine.tvm import Engine
    from lorac.runtime.errors import LoracError
    spec = ModelSpec.from_hf_config(LLAMA3_8B)
    with pytest.raises(LoracError, match="reads no tables from host memory"):
        Engine(spec, TrainSpec(batch=1, seq=8, lora_targets=("q_proj",), rank=4), {}, "cpu", cache_dir=tmp_path,
               host_tables=("model.embed_tokens.weight",))


def test_the_estimate_leaves_the_table_out():
    from lorac.graphs import ModelSpec
    from lorac.graphs.ops.quant import Quant
    from lorac.runtime.train import memory
    spec = ModelSpec.from_hf_config(LLAMA3_8B)
    assert memory.host_table(spec) == "model.embed_tokens.weight"
    assert memory.host_table(ModelSpec.from_hf_config(QWEN3_06B)) is None  # tied: the LM head too
    frozen = (7_000_000_000, 123)
    assert memory.frozen_on_device(spec, frozen, (), False) == frozen
    assert memory.frozen_on_device(spec, frozen, (), True) == (frozen[0] - 128256 * 4096, 123)
    nf4 = (("model.embed_tokens.weight", Quant("nf4", 64, False)),)
    blocks = 128256 * 4096 // 2 + 128256 * 4096 // 64 * 4 + 16 * 4  # codes, fp32 absmax, the code
    assert memory.frozen_on_device(spec, (5, 10**9), nf4, True) == (5, 10**9 - blocks)


def _plan(monkeypatch, config, quant=(), saved=None, **settings):
    from lorac.graphs import ModelSpec
    from lorac.runtime import devices
    from lorac.runtime.config import TrainConfig
    from lorac.runtime.train.plan import plan_run
    cuda = devices.for_target("cuda")
    monkeypatch.setattr(cuda, "memory_free", lambda: None)  # no GPU: the budget given
    monkeypatch.setattr(cuda, "host_pinnable", lambda: None)
    spec = ModelSpec.from_hf_config(config)
    frozen = (spec.vocab * spec.hidden * (1 if spec.tied else 2) + spec.layers * 2 * spec.hidden + spec.hidden,
              3_601_000_000) if quant else (8_030_000_000, 0)
    logs = []
    cfg = TrainConfig(**{"target": "cuda", "batch": 1, "seq": 2048, "rank": 16, "alpha": 32.0, **settings})
    return plan_run(cfg, spec, config, frozen, quant=quant, saved=saved, log=logs.append), logs


def _nf4_layers():
    from lorac.graphs import ModelSpec
    return nf4_layers(ModelSpec.from_hf_config(LLAMA3_8B))


def test_auto_moves_the_table_where_the_budget_binds(monkeypatch):
    layers = _nf4_layers()
    # 8B NF4 on an 8 GB budget: with the table on the host the dense tables fit (no NF4 embeddings)
    plan, logs = _plan(monkeypatch, LLAMA3_8B, layers, memory_budget=8.0)
    assert plan.cfg.offload_embeddings == "on" and plan.cfg.quantize_embeddings == "off"
    assert any(m.startswith("embeddings: model.embed_tokens.weight waits in pinned host memory (1.05 GB off the "
                            "GPU)") for m in logs)
    off, _ = _plan(monkeypatch, LLAMA3_8B, layers, memory_budget=8.0, offload_embeddings="off")
    assert off.cfg.quantize_embeddings == "nf4"  # the table on the device: only NF4 tables fit
    # a budget nothing binds: nothing moves
    plan, logs = _plan(monkeypatch, LLAMA3_8B, layers, memory_budget=140.0)
    assert (plan.cfg.checkpointing, plan.cfg.offload_embeddings) == ("off", "off")
    assert not any("host memory" in m for m in logs)
    # a dense 8B base at 4x2048 on a 20 GB budget: with the table freed the offloaded layers send their
    # attention state too (the faster backward), which with the table on the device does not fit
    on, _ = _plan(monkeypatch, LLAMA3_8B, batch=4, memory_budget=20.0)
    dev, _ = _plan(monkeypatch, LLAMA3_8B, batch=4, memory_budget=20.0, offload_embeddings="off")
    assert on.cfg.offload_embeddings == "on" and on.cfg.checkpointing == dev.cfg.checkpointing == "offload"
    assert (on.cfg.offload_state, dev.cfg.offload_state) == ("auto", "off")
    # asked checkpointing: auto follows it
    plan, _ = _plan(monkeypatch, LLAMA3_8B, checkpointing="offload")
    assert plan.cfg.offload_embeddings == "on"
    plan, _ = _plan(monkeypatch, LLAMA3_8B, checkpointing="off")
    assert plan.cfg.offload_embeddings == "off"
    # a tied table is the LM head too: auto leaves it, on is one line
    plan, _ = _plan(monkeypatch, QWEN3_06B, checkpointing="on")
    assert plan.cfg.offload_embeddings == "off"
    from lorac.runtime.errors import LoracError
    with pytest.raises(LoracError, match="also its LM head"):
        _plan(monkeypatch, QWEN3_06B, offload_embeddings="on")


def test_auto_takes_smaller_loss_chunks_to_keep_more_layers(monkeypatch):
    from lorac.runtime.train import memory
    from lorac.runtime.train.saved import SavedRun
    assert memory.loss_chunks(2048, 8192) == (2048, 1024, 512)
    assert memory.loss_chunks(0, 3000) == (0, 2048, 1024, 512)  # one chunk by default: powers of two below
    assert memory.loss_chunks(512, 8192) == (512,)
    # a dense 8B base at 4x2048 on 20 GB: 1024-token chunks (0.5 GB less logits than 2048) keep the top layer
    plan, logs = _plan(monkeypatch, LLAMA3_8B, batch=4, memory_budget=20.0)
    assert (plan.cfg.checkpointing, plan.cfg.keep_layers, plan.train.keep_layers) == ("offload", 1, 1)
    assert plan.cfg.loss_chunk == plan.train.loss_chunk == 1024  # recorded: a resumed run compiles the same step
    line = next(m for m in logs if m.startswith("memory: auto"))
    assert "keeping 1 of 32 layers" in line and "1024-token loss chunks" in line, line
    # ... and one layer more keeps its MLP half (TrainSpec.keep_mlp), recorded as the chunk is
    assert plan.cfg.keep_mlp == plan.train.keep_mlp == 1 and "; 1 of those keeps its MLP's gate and up" in line
    # --loss-chunk given: kept, and the layer is recomputed
    given, _ = _plan(monkeypatch, LLAMA3_8B, batch=4, memory_budget=20.0, loss_chunk=2048)
    assert (given.cfg.keep_layers, given.train.loss_chunk) == (0, 2048)
    # a budget the default chunk fits: the default stays
    roomy, _ = _plan(monkeypatch, LLAMA3_8B, batch=4, memory_budget=80.0)
    assert (roomy.cfg.loss_chunk, roomy.train.loss_chunk) == (0, 2048)
    # an NF4 head dequantizes once a chunk: no smaller chunks for it
    nf4, _ = _plan(monkeypatch, LLAMA3_8B, _nf4_layers(), batch=4, memory_budget=10.0, quantize_embeddings="nf4")
    assert (nf4.cfg.loss_chunk, nf4.train.loss_chunk) == (0, 2048)
    # resumed: the checkpoint's chunk and setting, whatever the budget now
    saved = SavedRun.from_state({"train_config": {"checkpointing": "offload", "keep_layers": 1, "loss_chunk": 1024,
                                                  "keep_mlp": 1}})
    again, logs = _plan(monkeypatch, LLAMA3_8B, saved=saved, batch=4, memory_budget=80.0, resume="ckpt")
    assert (again.cfg.keep_layers, again.train.loss_chunk, again.cfg.loss_chunk) == (1, 1024, 1024)
    assert again.train.keep_mlp == again.cfg.keep_mlp == 1
    assert "loss chunk: 1024 tokens (the checkpoint's)" in logs


def test_flag_values_and_devices():
    from lorac.runtime.cli import build_parser, train_config
    from lorac.runtime.config import TrainConfig
    from lorac.runtime.errors import LoracError
    parse = lambda *a: train_config(build_parser().parse_args(["train", *a]))
    assert parse().offload_embeddings == "auto"
    assert parse("--offload-embeddings", "on", "--target", "cuda").offload_embeddings == "on"
    with pytest.raises(LoracError, match="--offload-embeddings must be auto, on or off"):
        TrainConfig(offload_embeddings="yes").validate()
    with pytest.raises(LoracError, match="has no such device memory"):
        TrainConfig(offload_embeddings="on", target="cpu").validate()
    with pytest.raises(LoracError, match="has no such device memory"):
        TrainConfig(offload_embeddings="on", target="cuda", backend="ort").validate()
    # auto on the CPU or onnxruntime: off, whatever the checkpointing
    from lorac.graphs import ModelSpec
    from lorac.runtime import devices
    from lorac.runtime.train.plan import host_tables_possible
    spec = ModelSpec.from_hf_config(LLAMA3_8B)
    assert not host_tables_possible(TrainConfig(), spec, devices.for_target("cpu"))
    assert host_tables_possible(TrainConfig(target="cuda"), spec, devices.for_target("cuda"))
    assert not host_tables_possible(TrainConfig(target="cuda", backend="ort"), spec, devices.for_target("cuda"))
