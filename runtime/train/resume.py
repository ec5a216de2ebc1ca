"""What `--resume` keeps from the checkpoint, so a resumed run is the run that was interrupted.

- the model: its config *and* its weights (weights.fingerprint), checked by load_checkpoint;
- the training data: the sha256 of the packed training token stream (data.PackedData.digest),
  so another file, tokenizer or split is refused;
- the optimizer settings that shape the trajectory (TrainConfig's fields marked optimizer=True),
  refused when they differ;
- the learning-rate schedule: warmup + cosine over the steps the run was started with. A
  resumed run with a longer --steps holds the schedule's final lr past its end instead of
  stretching the cosine (which would make the lr jump back up);
- OUT/metrics.jsonl: lines past the checkpoint's step (steps the interrupted run made after
  its last checkpoint, which the resumed run makes again) are dropped.
"""
from __future__ import annotations

import json
from pathlib import Path

from lorac.core import atomic
from ..errors import LoracError

def check(saved, cfg, data_digest: str) -> None:
    """Refuse to resume the checkpoint's run `saved` (a SavedRun) with other training data or
    optimizer settings."""
    from ..config import TrainConfig
    for key in TrainConfig.optimizer_settings():
        old, new = saved.optimizer.get(key), getattr(cfg, key)
        if old is not None and old != new:
            flag = "--" + key.replace("_", "-")
            raise LoracError(f"--resume {saved.path}: it was trained with {flag} {old}, this run asks for {new}; "
                             "resume with the checkpoint's settings or start a new run")
    if saved.data_sha256 is not None and saved.data_sha256 != data_digest:
        raise LoracError(f"--resume {saved.path}: the training data differ from the checkpoint's (another --data file, --truncate, "
                         "tokenizer, --seq or eval split); resume with the same data or start a new run")


def schedule_steps(saved, cfg, log) -> int:
    """The total steps of the checkpoint's schedule (what lr_at decays over)."""
    total = saved.schedule_steps or saved.steps or cfg.steps
    if cfg.steps > total:
        log(f"resuming: the learning-rate schedule stays the checkpoint's (cosine to step {total}); "
            f"steps {total + 1}..{cfg.steps} run at its final lr")
    return int(total)


def truncate_metrics(path: Path, step: int) -> None:
    """Keep the lines of `path` up to `step` (and drop a line cut short by a kill), atomically."""
    if not path.is_file():
        return
    keep = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] <= step:
            keep.append(line + "\n")
    atomic.write_text(path, "".join(keep))
