"""One place for defaults: TrainConfig's fields (and LoraPlusConfig's, for the optimizer)
carry each setting's default and help; the CLI, its --help and the docs agree with them."""
from __future__ import annotations

import re
from dataclasses import MISSING, fields
from pathlib import Path

from lorac.runtime.cli import build_parser, train_config
from lorac.runtime.train.optim import LoraPlusConfig
from lorac.runtime.config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]


def _train_parser():
    return build_parser()._subparsers._group_actions[0].choices["train"]


def test_every_setting_has_help():
    for cls in (TrainConfig, LoraPlusConfig):
        bare = [f.name for f in fields(cls) if not f.metadata.get("help")]
        assert not bare, f"{cls.__name__} fields without help: {bare}"


def test_train_and_optimizer_defaults_are_one():
    cfg, opt = TrainConfig(), LoraPlusConfig()
    same = {"lr": "lr", "loraplus_ratio": "loraplus_ratio", "warmup": "warmup_steps",
            "weight_decay": "weight_decay", "max_grad_norm": "max_grad_norm"}
    assert set(same) == set(TrainConfig.optimizer_settings())
    for mine, theirs in same.items():
        assert getattr(cfg, mine) == getattr(opt, theirs), mine
    built = cfg.optim_config()
    assert all(getattr(built, f.name) == getattr(opt, f.name) for f in fields(LoraPlusConfig) if f.name != "total_steps")
    assert built.total_steps == cfg.steps


def test_no_flags_give_the_dataclass_defaults():
    assert train_config(_train_parser().parse_args([])) == TrainConfig()


def test_help_shows_each_default_next_to_its_flag():
    p = _train_parser()
    text = "".join(p.format_help().split())  # no whitespace at all: argparse wraps long words too
    by_dest = {a.dest: a for a in p._actions}
    for f in fields(TrainConfig):
        if f.name == "extra":
            continue
        action = by_dest[f.name]
        help_ = " ".join(action.help.split())
        assert help_ and "".join(help_.split()) in text, f.name
        d = f.default if f.default is not MISSING else None
        if d is not None and not isinstance(d, bool):
            assert help_.endswith(f"(default: {d})"), f"--{f.name}: {help_}"
    # the LoRA targets' flags after the rename (Python 3.13 shows the metavar once)
    assert re.search(r"--targets(TARGETS)?,--target-modulesTARGETS", text)
    assert train_config(p.parse_args(["--targets", "q_proj,v_proj"])).lora_targets == ("q_proj", "v_proj")


def test_the_optimizer_docs_table_matches_the_defaults():
    """docs/OPTIMIZER.md's defaults table states LoraPlusConfig's values."""
    rows = dict(re.findall(r"^\| ([\w, ]+?) \| ([^|]+?) \|", (ROOT / "docs" / "OPTIMIZER.md").read_text(), re.M))
    opt = LoraPlusConfig()
    for f in fields(LoraPlusConfig):
        if f.name == "betas":
            betas, eps = rows["betas, eps"].rsplit(", ", 1)
            assert (betas, float(eps)) == (str(opt.betas), opt.eps)
        elif f.name != "eps":
            assert float(rows[f.name]) == float(getattr(opt, f.name)), f.name


def test_quantized_base_auto_keeps_on_cuda_and_on_cpu_only_when_dense_would_not_fit(monkeypatch):
    """--quantized-base auto: cuda keeps a quantized base's blocks; the CPU dequantizes it (the
    faster step) unless the dense weights would take more than half of the free memory; keep,
    dequantize and --quantize decide by themselves, without asking for the dense size."""
    from lorac.runtime import devices
    cpu = devices.for_target("cpu")
    monkeypatch.setattr(cpu, "memory_free", lambda: 8 * 10**9)
    asked = []
    size = lambda n: lambda: asked.append(n) or n  # noqa: E731
    assert TrainConfig().keeps_quantized(size(4 * 10**9)) is False and asked == [4 * 10**9]
    assert TrainConfig().keeps_quantized(size(4 * 10**9 + 1)) is True
    assert TrainConfig().keeps_quantized() is False  # no size known: dense
    asked.clear()
    assert TrainConfig(quantized_base="dequantize").keeps_quantized(size(10**12)) is False
    assert TrainConfig(quantized_base="keep").keeps_quantized(size(1)) is True
    assert TrainConfig(quantize="int8").keeps_quantized(size(1)) is True
    assert TrainConfig(target="cuda").keeps_quantized(size(1)) is True and asked == []
    monkeypatch.setattr(cpu, "memory_free", lambda: None)  # nothing known about the memory: dense
    assert TrainConfig().keeps_quantized(size(10**12)) is False
