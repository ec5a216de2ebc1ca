"""--checkpointing auto (runtime/train/memory.py): the memory estimate against the static plans
the CUDA compiler makes (its Relax passes, no GPU or nvcc needed), the choice of setting for
a budget, and how the run resolves the setting (target, backend, budget, resume)."""
from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from lorac.graphs import ModelSpec, TrainSpec
from lorac.graphs.families import for_spec
from lorac.runtime.train import memory as step_memory
from lorac.runtime.errors import LoracError

LLAMA3_8B = dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False)
# small enough to compile in seconds, wide enough that the layers, not the loss, dominate
LLAMA_GQA4 = dict(model_type="llama", vocab_size=4096, hidden_size=1024, intermediate_size=2816, num_hidden_layers=3,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=128, tie_word_embeddings=False)
QWEN3_SMALL = dict(model_type="qwen3", vocab_size=4096, hidden_size=512, intermediate_size=1408, num_hidden_layers=3,
                   num_attention_heads=6, num_key_value_heads=3, head_dim=64, tie_word_embeddings=True)
MAMBA_SMALL = dict(model_type="mamba", vocab_size=4096, hidden_size=256, state_size=16, expand=2, conv_kernel=4,
                   num_hidden_layers=3, tie_word_embeddings=True)


def _train(cfg, B, S, **kw):
    spec = ModelSpec.from_hf_config(cfg)
    fam = for_spec(spec)
    return spec, TrainSpec(batch=B, seq=S, lora_targets=fam.TARGETS, rank=16, alpha=32,
                           extra=fam.train_extra("cuda", 0), **kw)


@pytest.mark.parametrize("cfg,B,S,settings", [
    (LLAMA_GQA4, 2, 1000, [(False, 0), (True, 0), (True, 1)]),  # GQA 4, seq not a power of two, untied
    (QWEN3_SMALL, 3, 768, [(False, 0), (True, 2)]),  # q/k norms, tied head, GQA 2
    (MAMBA_SMALL, 2, 1000, [(False, 0), (True, 0)]),
], ids=["llama-gqa4", "qwen3", "mamba"])
def test_estimate_follows_the_compiled_plan(cfg, B, S, settings, tmp_path):
    pytest.importorskip("tvm")
    from _compiler_graphs import cuda_plan

    from lorac.runtime.engine.tvm import Engine
    from lorac.runtime.train.optim import LoraPlusConfig

    plans, estimates = [], []
    for ckpt, keep in settings:
        spec, train = _train(cfg, B, S, checkpointing=ckpt, keep_layers=keep)
        engine = Engine(spec, train, {}, "cuda", "bfloat16", tmp_path, LoraPlusConfig(), log=lambda m: None)
        model = engine._recipe("train")[0]()  # the graph `lorac train` compiles (flat LoRA buffers)
        plans.append(cuda_plan(model, "bfloat16", cuda_graph=True)["static_plan_bytes"])
        estimates.append(step_memory.plan_bytes(spec, train))
    for setting, plan, est in zip(settings, plans, estimates):
        assert 0.93 <= est / plan <= 1.1, (setting, plan, est)
    assert sorted(range(len(plans)), key=plans.__getitem__) == sorted(range(len(plans)), key=estimates.__getitem__)


def test_choice_is_the_fastest_setting_that_fits():
    spec, train = _train(LLAMA3_8B, 4, 2048, loss_chunk=2048)
    n_weights = 8_030_000_000
    est = lambda ckpt, keep: step_memory.estimate(spec, replace(train, checkpointing=ckpt, keep_layers=keep), n_weights)
    # more kept layers cost more; keeping every layer lean costs less than no checkpointing
    assert est(True, 0) < est(True, 16) < est(True, 32) < est(False, 0)
    roomy = step_memory.choose(spec, train, n_weights, "bfloat16", 200 * 10**9, "test")
    assert (roomy.checkpointing, roomy.keep_layers) == (False, 0)
    budget, _ = step_memory.budget_from(None, 40.0)
    mid = step_memory.choose(spec, train, n_weights, "bfloat16", budget, "test")
    assert mid.checkpointing and 0 < mid.keep_layers < 32
    assert est(True, mid.keep_layers) <= budget < est(True, mid.keep_layers + 1)
    assert "no checkpointing needs" in mid.why
    tight = step_memory.choose(spec, train, n_weights, "bfloat16", 10 * 10**9, "test")
    assert (tight.checkpointing, tight.keep_layers) == (True, 0) and "trying it anyway" in tight.why
    blind = step_memory.choose(spec, train, n_weights, "bfloat16", None, "no GPU visible")
    assert (blind.checkpointing, blind.need) == (False, None)


def test_no_estimate_where_attention_keeps_scores(monkeypatch):
    spec, train = _train(LLAMA_GQA4, 2, 256)
    assert step_memory.plan_bytes(spec, train, dtype="float32") is None  # fp32: not cuDNN's unit
    # packed documents on lorac's kernels (Triton at compile time) hold what plain rows hold; on cuDNN
    # (no Triton) plain rows' estimate plus their bias [B, 1, S, S] bf16, or nothing more past the
    # bias' bound (cuDNN's ragged layout)
    plain = step_memory.plan_bytes(spec, train)
    import lorac.core.constants as constants
    monkeypatch.setattr(constants, "packed_kernels_available", lambda: True)
    assert step_memory.plan_bytes(spec, replace(train, packing="isolated")) == plain
    odd = replace(spec, head_dim=96)  # a head size the kernels do not take: cuDNN's bias
    assert step_memory.plan_bytes(odd, replace(train, packing="isolated")) == \
        step_memory.plan_bytes(odd, train) + 2 * 2 * 256 * 256
    monkeypatch.setattr(constants, "packed_kernels_available", lambda: False)
    assert step_memory.plan_bytes(spec, replace(train, packing="isolated")) == plain + 2 * 2 * 256 * 256
    long_rows = replace(train, batch=8, seq=8192)
    assert step_memory.plan_bytes(spec, replace(long_rows, packing="isolated")) == step_memory.plan_bytes(spec, long_rows)
    windowed, wtrain = _train({**LLAMA_GQA4, "model_type": "mistral", "sliding_window": 128}, 2, 256)
    assert step_memory.plan_bytes(windowed, wtrain) is None
    assert step_memory.plan_bytes(windowed, replace(wtrain, seq=128)) is not None
    choice = step_memory.choose(spec, train, 0, "float32", 10**12, "test")
    assert not choice.checkpointing and "no memory estimate" in choice.why


def test_budget_sources():
    assert step_memory.budget_from(None, None) == (None, "no GPU visible")
    free = 100 * 2**30
    got, why = step_memory.budget_from(free, None)
    assert got == free - 5 * 2**30 and "free on the GPU" in why  # 5 %: more than 2 GiB here
    got, _ = step_memory.budget_from(10 * 2**30, None)
    assert got == 8 * 2**30  # at least 2 GiB held back
    got, why = step_memory.budget_from(free, 40.0)
    assert got == 40 * 10**9 - step_memory.WORKSPACE and "--memory-budget 40" in why


# -- how a run resolves the setting ------------------------------------------------------
def _resolve(monkeypatch, free=None, saved=None, **cfg):
    """The plan's choice (train/plan.py choose_checkpointing) as a run holds it: run.cfg,
    run.train_spec, and the log line."""
    from lorac.runtime import devices
    from lorac.runtime.config import TrainConfig
    from lorac.runtime.train.plan import choose_checkpointing

    monkeypatch.setattr(devices.for_target("cuda"), "memory_free", lambda: free)
    monkeypatch.setattr(devices.for_target("cpu"), "memory_free", lambda: 512 * 10**9)  # the host: room to pin
    spec, train = _train(LLAMA3_8B, 4, 2048, loss_chunk=2048)
    logs = []
    cfg = TrainConfig(**cfg)
    cfg, train = choose_checkpointing(cfg, spec, train, (8_030_000_000, 0), devices.for_target(cfg.target), saved=saved,
                                      dp=SimpleNamespace(size=1), log=logs.append)
    return SimpleNamespace(cfg=cfg, train_spec=train), logs


def test_run_resolves_auto(monkeypatch):
    run, logs = _resolve(monkeypatch)  # cpu: off, as before
    assert (run.cfg.checkpointing, run.train_spec.checkpointing) == ("off", False)
    assert logs == ["memory: auto: checkpointing off (auto is off on --target cpu)"]
    run, logs = _resolve(monkeypatch, target="cuda", memory_budget=40.0)
    # 40 GB: no layer recomputed whole; the kept layers and those keeping their MLP half leave one layer's MLP half
    # to recompute, the others' inputs and attention state offloaded
    keep, mlp = run.cfg.keep_layers, run.cfg.keep_mlp
    assert run.cfg.checkpointing == "offload" and (keep, mlp) == (run.train_spec.keep_layers, run.train_spec.keep_mlp)
    assert 0 < keep < 32 and keep + mlp == 31 and run.train_spec.offload, (keep, mlp)
    assert logs[0] == (f"loss chunk: {run.train_spec.loss_chunk} tokens (--checkpointing auto: the default 2048's "
                       "logits leave no room for the setting below)") and run.train_spec.loss_chunk < 2048
    assert logs[1].startswith(f"memory: auto: checkpointing on, keeping {keep} of 32 layers, their inputs and "
                              f"attention state offloaded to host memory") and f"; {mlp} of those keep" in logs[1]
    run, logs = _resolve(monkeypatch, free=140 * 10**9, target="cuda")  # a whole H200: nothing to recompute
    assert run.cfg.checkpointing == "off" and "free on the GPU" in logs[0]
    run, logs = _resolve(monkeypatch, free=None, target="cuda")  # compile-only, no GPU, no budget
    assert run.cfg.checkpointing == "off" and "no budget to fit" in logs[0]
    run, _ = _resolve(monkeypatch, target="cuda", backend="ort")
    assert run.cfg.checkpointing == "off"
    run, logs = _resolve(monkeypatch, target="cuda", memory_budget=16.0)  # a bf16 8B base on a 16 GB card
    assert "trying it anyway; --quantize nf4 (or int8) keeps the linear weights in 4-bit" in logs[-1]
    run, logs = _resolve(monkeypatch, target="cuda", keep_layers=5)
    assert (run.cfg.checkpointing, run.train_spec.keep_layers) == ("on", 5) and "--keep-layers given" in logs[0]


def test_resume_adopts_the_checkpoints_setting(monkeypatch):
    from lorac.runtime.train.saved import SavedRun
    for saved, want in ((True, ("on", 3)), ("on", ("on", 3)), (False, ("off", 0)), ("off", ("off", 0))):
        state = {"train_config": {"checkpointing": saved, "keep_layers": 3}}  # true/false: when it was a switch
        run, logs = _resolve(monkeypatch, free=140 * 10**9, saved=SavedRun.from_state(state), target="cuda",
                             resume="ck")
        assert (run.cfg.checkpointing, run.cfg.keep_layers) == want and "the checkpoint's setting" in logs[0]


def test_auto_drops_the_offloaded_state_before_it_gives_up(monkeypatch):
    """--offload-state auto sends the attention state with the offloaded inputs (Llama-3-8B); where
    even every layer recomputed does not fit with it, the offloaded settings are tried with the
    inputs alone (smaller staging) before `auto` gives up, and the run records `off` for --resume."""
    from lorac.runtime import devices
    from lorac.runtime.train.saved import SavedRun
    spec, train = _train(LLAMA3_8B, 4, 2048, loss_chunk=2048)  # as _resolve's run
    n = 8_030_000_000
    monkeypatch.setattr(devices.for_target("cuda"), "host_pinnable", lambda: None)  # whatever this host has
    lean = lambda **kw: step_memory.estimate(spec, replace(train, checkpointing=True, keep_layers=0, offload=True, **kw), n)
    with_state, inputs_alone = lean(), lean(offload_state=False)
    assert inputs_alone < with_state  # 3 slots of 8192 x 4096 bf16 against 3 of the state's
    budget = (with_state + inputs_alone) // 2
    choice = step_memory.choose(spec, train, n, "bfloat16", budget, "test", offload=True)
    assert choice.offload and choice.state_off and choice.need <= budget and choice.keep_layers == 0
    assert "with their attention state offloaded too every layer recomputed needs" in choice.why
    roomy = step_memory.choose(spec, train, n, "bfloat16", with_state, "test", offload=True)
    assert roomy.offload and not roomy.state_off  # the state fits: kept
    asked_on = step_memory.choose(spec, replace(train, offload_state=True), n, "bfloat16", budget, "test", offload=True)
    assert not asked_on.state_off and asked_on.need > budget  # --offload-state on is not overridden
    none_fit = step_memory.choose(spec, train, n, "bfloat16", inputs_alone - 1, "test", offload=True)
    assert none_fit.offload and none_fit.state_off and "trying it anyway" in none_fit.why  # the leanest
    # the run: a budget between the two (--memory-budget counts 1 GiB of workspaces beside the step)
    gb = (budget + step_memory.WORKSPACE) / 1e9
    run, logs = _resolve(monkeypatch, target="cuda", memory_budget=gb, offload_embeddings="off")  # estimated as above
    assert run.cfg.checkpointing == "offload" and run.cfg.offload_state == "off"
    assert run.train_spec.offload_state is False and "their inputs offloaded to host memory" in logs[-1]
    assert devices.for_target("cuda").OFFLOADS
    # --resume of that run compiles the same graph: the state stays off where the flag is auto
    state = {"train_config": {"checkpointing": "offload", "keep_layers": 0, "offload_state": "off"}}
    run, _ = _resolve(monkeypatch, free=140 * 10**9, saved=SavedRun.from_state(state), target="cuda", resume="ck")
    assert run.train_spec.offload_state is False and run.cfg.offload_state == "off"


def test_flags_and_config_values():
    from lorac.runtime.cli import build_parser, train_config
    from lorac.runtime.config import TrainConfig

    parse = lambda *a: train_config(build_parser().parse_args(["train", *a]))
    assert parse().checkpointing == "auto"
    assert parse("--checkpointing").checkpointing == "on"  # the flag alone, as when it was a switch
    assert parse("--checkpointing", "--keep-layers", "3").keep_layers == 3
    assert parse("--checkpointing", "off").checkpointing == "off"
    assert parse("--memory-budget", "39.5").memory_budget == 39.5
    from lorac.graphs import ModelSpec
    spec = ModelSpec(arch="qwen3", vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, head_dim=8, intermediate=48)
    for flag, want in (("auto", None), ("on", True), ("off", False)):  # TrainSpec.offload_state: None is the rule
        cfg = parse("--checkpointing", "offload", "--offload-state", flag, "--target", "cuda")
        assert (cfg.offload_state, cfg.train_spec(spec).offload_state) == (flag, want)
    assert parse().train_spec(spec).offload_state is None  # the default (config.OFFLOAD_STATE_DEFAULT)
    for old, new in ((True, "on"), (False, "off")):  # API use and configs from when it was a bool
        cfg = TrainConfig(checkpointing=old)
        cfg.validate()
        assert cfg.checkpointing == new
    for bad, match in ((dict(checkpointing="maybe"), "--checkpointing must be auto, on, off or offload"),
                       (dict(memory_budget=-1.0), "--memory-budget must be a positive number"),
                       (dict(memory_budget="lots"), "--memory-budget must be a positive number"),
                       (dict(checkpointing="off", keep_layers=2), "--keep-layers keeps some layers"),
                       (dict(keep_layers=-1), "--keep-layers must be an integer >= 0"),
                       (dict(offload_state="yes"), "--offload-state must be auto, on or off")):
        with pytest.raises(LoracError, match=match):
            TrainConfig(**bad).validate()


def test_toml_config_takes_the_old_and_new_spellings(tmp_path):
    from lorac.runtime.cli import build_parser, train_config
    for text, want in (("checkpointing = true\n", "on"), ('checkpointing = "auto"\nmemory_budget = 40\n', "auto")):
        (tmp_path / "c.toml").write_text(text)
        cfg = train_config(build_parser().parse_args(["train", "--config", str(tmp_path / "c.toml")]))
        cfg.validate()
        assert cfg.checkpointing == want
    (tmp_path / "c.toml").write_text('memory_budget = "40"\n')
    with pytest.raises(LoracError, match="memory_budget = '40' must be a number"):
        train_config(build_parser().parse_args(["train", "--config", str(tmp_path / "c.toml")]))
