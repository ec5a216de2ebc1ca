"""What a training run writes into --out, checked before anything loads or trains.

A run writes only these names in --out (RUN_FILES): metrics.jsonl, loss.png, summary.json,
the lock file, checkpoints/, adapter/ and runs/ (TensorBoard). Refused at once, in one line:
- an --out that is, or lies inside, something the run reads (--model, --data, --eval-data,
  --adapter), or one of whose run names is such a path (`--adapter OUT/adapter`);
- an --out that holds an HF model (config.json beside its weights): the run files would land
  beside someone's weights (a .gguf file there is left alone: no run name collides with it);
- a symbolic link at any of the run names: lorac never writes through a link;
- an adapter/ that lorac's export would not replace (output.check_replaceable: another
  model, or the user's files); one written by a run before export markers existed is marked
  now, so the run's export at the end may replace it.
"""
from __future__ import annotations

import os
from pathlib import Path

from ..errors import LoracError

LOCK = ".lorac.lock"  # run.LOCK_FILE
RUN_FILES = ("metrics.jsonl", "loss.png", "summary.json", LOCK, "checkpoints", "adapter", "runs")
MODEL_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


def check_run_dir(cfg) -> None:
    out = Path(cfg.out)
    dest = os.path.realpath(out)
    reads = {"--model": cfg.model, "--data": cfg.data, "--eval-data": cfg.eval_data, "--adapter": cfg.adapter}
    for flag, path in reads.items():
        if not path or not os.path.exists(path):
            continue
        real = os.path.realpath(path)
        if real == dest or _inside(dest, real):
            how = "is" if real == dest else "lies inside"
            raise LoracError(f"--out {out} {how} {path} ({flag}), which this run reads; a run writes its files "
                             "there: choose another --out")
        hit = next((n for n in RUN_FILES if not (out / n).is_symlink() and _covers(os.path.realpath(out / n), real)), None)
        if hit:
            raise LoracError(f"the run would replace {out / hit}, which {flag} reads; choose another --out")
    if out.exists() and not out.is_dir():
        raise LoracError(f"--out {out} is a file; a run writes a directory")
    if not out.is_dir():
        return
    model = next((n for n in MODEL_FILES if (out / n).exists()), None) if (out / "config.json").exists() else None
    if model:
        raise LoracError(f"--out {out} holds {model}: it looks like a model directory, and a run writes its files "
                         "(metrics.jsonl, checkpoints/, adapter/, ...) there; choose another --out")
    link = next((n for n in RUN_FILES if (out / n).is_symlink()), None)
    if link:
        raise LoracError(f"{out / link} is a symbolic link (to {os.readlink(out / link)}); lorac does not write "
                         "through links in --out: remove it or choose another --out")
    adapter = out / "adapter"
    if adapter.exists():
        from ..export import PEFT_FILES
        from ..export.output import check_replaceable, marked, write_marker
        earlier_run = (out / LOCK).is_file()  # a lorac run wrote here before export markers existed
        check_replaceable(adapter, PEFT_FILES, legacy=earlier_run, label=str(adapter))
        if earlier_run and any(adapter.iterdir()) and not marked(adapter):
            write_marker(adapter, "peft")


def _inside(path: str, folder: str) -> bool:
    return path.startswith(folder.rstrip(os.sep) + os.sep)


def _covers(name: str, real: str) -> bool:
    return real == name or _inside(real, name)
