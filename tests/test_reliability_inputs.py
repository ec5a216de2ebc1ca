"""Reliability, issue 31, silent wrong (cases 9-17) and the flags of "Also mend": a run that
would learn nothing (non-finite frozen weights, absurd scales, skipped steps) does not exit 0,
the weights are the model the config describes, an eval over nothing is no 0.0, and every bad
flag value is one line naming the flag. Each test would fail on the code before the fix.
"""
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from test_reliability import _config_dir, lorac, one_line_error, work  # noqa: F401 (work: the fixture)
from test_train_e2e import _records, _train_args

pytest.importorskip("tvm")


def _edited_weights(work, tmp_path, edit) -> Path:
    """A copy of the tiny model with edit(weights) applied to its safetensors."""
    from safetensors.numpy import load_file, save_file
    d = tmp_path / "model"
    shutil.copytree(work / "model", d)
    w = load_file(str(d / "model.safetensors"))
    edit(w)
    save_file(w, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d


# -- 9-11. a non-finite value in a frozen weight -------------------------------------------------
@pytest.mark.parametrize("name,value", [("model.layers.0.self_attn.q_proj.weight", np.nan),
                                        ("model.embed_tokens.weight", np.inf)])
def test_a_non_finite_frozen_weight_is_refused_at_load(work, tmp_path, capsys, monkeypatch, name, value):
    def poison(w):
        w[name][3, 5] = value
    model = _edited_weights(work, tmp_path, poison)
    rc, err = lorac(_train_args(work, tmp_path / "run", 2, "--model", model), capsys, monkeypatch)
    one_line_error(rc, err, f"tensor {name} holds {value} at [3, 5]")
    assert not (tmp_path / "run" / "adapter").exists()


def test_a_nan_in_a_gguf_weight_is_refused_at_load(tmp_path):
    pytest.importorskip("gguf")
    from test_gguf import hf_weights, write_gguf

    from lorac.runtime.errors import LoracError
    from lorac.runtime.model.weights import load_model
    w = hf_weights("llama", np.random.default_rng(0))
    w["model.layers.1.mlp.down_proj.weight"][0, 2] = np.nan
    write_gguf(tmp_path / "m.gguf", "llama", w, qtype="F16")
    with pytest.raises(LoracError, match=r"tensor model.layers.1.mlp.down_proj.weight holds nan at \[0, 2\]"):
        load_model(tmp_path / "m.gguf")


def test_a_run_whose_steps_were_all_skipped_exits_nonzero(work, tmp_path, capsys, monkeypatch):
    """Past the load check (switched off here), every loss is NaN: the run says it learned nothing."""
    from lorac.runtime.model import checks
    monkeypatch.setattr(checks, "check_finite", lambda weights, source: None)
    model = _edited_weights(work, tmp_path, lambda w: w["model.norm.weight"].__setitem__(0, np.nan))
    out = tmp_path / "run"
    rc, err = lorac(_train_args(work, out, 3, "--model", model), capsys, monkeypatch)
    one_line_error(rc, err, "3 of 3 steps were skipped (non-finite loss or gradient norm), more than 50%")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["updates"] == 0 and summary["skipped"] == 3 and summary["failed"].startswith("3 of 3")
    assert not (out / "adapter").exists()


def test_the_skipped_share_rule():
    from lorac.runtime.train.report import skipped_verdict
    assert skipped_verdict(10, 5) is None and skipped_verdict(0, 0) is None
    assert "learned too little" in skipped_verdict(10, 6) and "learned nothing" in skipped_verdict(4, 4)


def test_finite_check_cost_is_one_pass():
    """check_finite reads each tensor once (a sum); a big finite tensor costs no bool copy of it."""
    import tracemalloc

    from lorac.runtime.model.checks import check_finite
    w = {"a": np.ones((2048, 2048), np.float32), "big": np.full((8, 8), 3e38, np.float32)}  # "big" overflows the sum
    tracemalloc.start()
    check_finite(w, "m")
    assert tracemalloc.get_traced_memory()[1] < 1 << 20
    tracemalloc.stop()


# -- 12. bounds of the LoRA scale and the learning rates ---------------------------------------------
@pytest.mark.parametrize("extra,match", [
    (["--alpha", "1e30"], "the LoRA scale --alpha/r = 6.25e+28 must lie in (0, 1000]"),
    (["--alpha", "1e4", "--rslora", "--rank", "4"], "the LoRA scale --alpha/sqrt(r) = 5000 must lie in (0, 1000]"),
    (["--lr", "5"], "--lr 5 must lie in (0, 1]"),
    (["--lr", "-1e-3"], "--lr -0.001 must lie in (0, 1]"),  # read as a value, not a flag
    (["--lr=-1e-3"], "--lr -0.001 must lie in (0, 1]"),
    (["--loraplus-ratio", "1e9"], "--loraplus-ratio 1e+09 must lie in (0, 1000]"),
    (["--weight-decay", "-0.1"], "--weight-decay -0.1 must lie in [0, 1]"),
    (["--keep-checkpoints", "0"], "--keep-checkpoints must be an integer >= 1"),
    (["--keep-checkpoints", "-1"], "--keep-checkpoints must be an integer >= 1"),
    (["--targets", ","], "names no LoRA target"),
    (["--seed", "-1"], "--seed must be an integer >= 0, got -1"),
    (["--warmup", "-2"], "--warmup must be an integer >= 0"),
])
def test_out_of_range_settings_are_one_line(work, tmp_path, capsys, monkeypatch, extra, match):
    args = [a for a in _train_args(work, tmp_path / "run", 2) if a != "--targets"]
    at = args.index("q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj")
    args = args[:at] + args[at + 1:]  # the test's own --targets out of the way
    one_line_error(*lorac(args + extra, capsys, monkeypatch), match)
    assert not (tmp_path / "run").exists()


def test_an_adapters_alpha_is_bounded_too(work, tmp_path, capsys, monkeypatch):
    adapter = tmp_path / "adapter"
    rc, err = lorac(["export", "--checkpoint", work / "ref" / "checkpoints", "--out", adapter], capsys, monkeypatch)
    assert rc == 0, err
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**cfg, "lora_alpha": 1e30}))
    one_line_error(*lorac(_train_args(work, tmp_path / "run", 2, "--adapter", adapter), capsys, monkeypatch),
                   "must lie in (0, 1000]")


def test_generate_flags_name_themselves(work, capsys, monkeypatch):
    ck = work / "ref" / "checkpoints"
    for extra, match in [(["--repetition-penalty", "0"], "--repetition-penalty must be > 0 (1: none), got 0.0"),
                         (["--seed", "-1"], "--seed must be an integer >= 0, got -1"),
                         (["--top-p", "0"], "--top-p must lie in (0, 1]")]:
        one_line_error(*lorac(["generate", "--checkpoint", ck, "--prompt", "x", "--cache-dir", work / "cache", *extra],
                              capsys, monkeypatch), match)


# -- 13. tensors that no part of the model reads -------------------------------------------------
def test_weights_of_more_layers_than_the_config_are_refused(work, tmp_path, capsys, monkeypatch):
    model = _config_dir(work, tmp_path, lambda c: c.update(num_hidden_layers=1))
    one_line_error(*lorac(_train_args(work, tmp_path / "run", 2, "--model", model), capsys, monkeypatch),
                   "tensor(s) that no part of the model reads, e.g. model.layers.1.input_layernorm.weight; config.json "
                   "says num_hidden_layers=1, the weights hold layer 1")


def test_harmless_extra_tensors_pass():
    """A tied lm_head.weight (transformers ties it on load too) and RoPE inv_freq buffers."""
    from lorac.runtime.errors import LoracError
    from lorac.runtime.model.checks import check_weights, required_tensors
    cfg = {"model_type": "qwen3", "num_hidden_layers": 1, "tie_word_embeddings": True}
    w = {n: np.zeros(2, np.float32) for n in required_tensors(cfg)}
    check_weights(cfg, {**w, "lm_head.weight": np.zeros(2, np.float32),
                        "model.layers.0.self_attn.rotary_emb.inv_freq": np.zeros(2, np.float32)}, "m")
    with pytest.raises(LoracError, match="e.g. model.layers.0.mlp.gate_proj.bias; the config and the weights"):
        check_weights(cfg, {**w, "model.layers.0.mlp.gate_proj.bias": np.zeros(2, np.float32)}, "m")
    llama = {"model_type": "llama", "num_hidden_layers": 1, "attention_bias": True}  # o_proj's bias is read
    assert "model.layers.0.self_attn.o_proj.bias" in required_tensors(llama)


# -- 16. no eval set ---------------------------------------------------------------------------------
def test_no_eval_set_means_no_eval_loss(work, tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    rc, err = lorac(_train_args(work, out, 2, "--eval-fraction", "0"), capsys, monkeypatch)
    assert rc == 0, err[-2000:]
    assert "eval: none (--eval-fraction 0 and no --eval-data): no eval loss is computed" in err
    assert "eval loss before" not in err and "eval loss:" not in err and "eval loss after" not in err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_loss_before"] is None and summary["eval_loss_after"] is None
    assert not any("eval_loss" in r for r in _records(out))


# -- 17. lorac eval over nothing --------------------------------------------------------------------
@pytest.mark.parametrize("extra,match", [(["--batch", "-1"], "--batch must be positive, got -1"),
                                         (["--batch", "0"], "--batch must be positive, got 0"),
                                         (["--seq", "0"], "--seq must be positive, got 0")])
def test_eval_refuses_sizes_that_score_nothing(work, capsys, monkeypatch, extra, match):
    one_line_error(*lorac(["eval", "--checkpoint", work / "ref" / "checkpoints", "--data", work / "corpus.txt",
                           "--cache-dir", work / "cache", *extra], capsys, monkeypatch), match)
