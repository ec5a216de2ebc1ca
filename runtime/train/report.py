"""Where a run's progress goes: OUT/metrics.jsonl (one JSON line per step and per eval), the
terminal, and TensorBoard when asked (--report-to tensorboard).

On a terminal the steps show as a tqdm bar with loss, learning rate, grad norm, tokens/s and
the ETA, and compiling as a bar over the graphs; log lines go above the bar. Where stderr is
not a terminal (a log file, CI) each step is one line instead (--progress bar|lines forces
either). TensorBoard scalars go to OUT/runs through tensorboardX (pip install
'lorac[tensorboard]'), under the names transformers' Trainer uses (train/loss,
train/learning_rate, train/grad_norm, eval/loss).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from ..errors import LoracError

PROGRESS = ("auto", "bar", "lines")
# More steps skipped than this share (a non-finite loss or gradient norm: the update is not
# applied) and the run learned next to nothing: it ends nonzero and writes no adapter/.
MAX_SKIPPED_SHARE = 0.5
REPORT_TO = ("none", "tensorboard")


def check_report_settings(progress: str, report_to: str) -> None:
    if progress not in PROGRESS:
        raise LoracError(f"--progress must be one of {', '.join(PROGRESS)}, got {progress!r}")
    bad = [r for r in report_to.split(",") if r.strip() not in REPORT_TO]
    if bad:
        raise LoracError(f"--report-to takes {' or '.join(REPORT_TO)}, got {', '.join(bad)}")


def skipped_verdict(steps: int, skipped: int) -> str | None:
    """Why a finished run failed for its skipped steps (more than MAX_SKIPPED_SHARE), or None."""
    if not steps or skipped <= MAX_SKIPPED_SHARE * steps:
        return None
    return (f"{skipped} of {steps} steps were skipped (non-finite loss or gradient norm), more than "
            f"{MAX_SKIPPED_SHARE:.0%}: the adapter learned {'nothing' if skipped == steps else 'too little'}, so none "
            "is written; lower --lr or --alpha, or check the data and the model's weights")


def use_bar(progress: str) -> bool:
    return progress == "bar" or (progress == "auto" and sys.stderr.isatty())


class Report:
    def __init__(self, out: Path, progress: str, report_to: str, resume: bool, log):
        from ..files import open_run_file  # never through a link planted in --out
        self.metrics = open_run_file(out / "metrics.jsonl", append=bool(resume))
        self.bar = None  # made at the first step, below whatever compiling and evaluating printed
        self.wants_bar, self._log = use_bar(progress), log
        self.tb = _tensorboard(out) if "tensorboard" in report_to else None

    def log(self, msg: str) -> None:
        if self.bar is not None:
            self.bar.write(msg, file=sys.stderr)
        else:
            self._log(msg)

    def _emit(self, rec: dict) -> None:
        self.metrics.write(json.dumps(rec) + "\n")
        self.metrics.flush()

    def eval(self, step: int, loss: float) -> None:
        self._emit(dict(step=step, eval_loss=loss))
        if self.tb is not None:
            self.tb.add_scalar("eval/loss", loss, step)

    def step(self, rec: dict, total: int, eta: float) -> None:
        self._emit(rec)
        if self.tb is not None:
            for key, name in (("loss", "loss"), ("lr", "learning_rate"), ("grad_norm", "grad_norm"),
                              ("tokens_per_s", "tokens_per_second")):
                self.tb.add_scalar(f"train/{name}", rec[key], rec["step"])
        if self.wants_bar and self.bar is None:
            from tqdm import tqdm
            self.bar = tqdm(total=total, initial=rec["step"] - 1, unit="step", dynamic_ncols=True, file=sys.stderr)
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{rec['loss']:.4f}", lr=f"{rec['lr']:.1e}", gnorm=f"{rec['grad_norm']:.3f}",
                                 tok_s=f"{rec['tokens_per_s']:.0f}", refresh=False)
            self.bar.update(1)
        else:
            self._log(f"step {rec['step']:5d}/{total} | loss {rec['loss']:.4f} | lr {rec['lr']:.2e} | gnorm "
                      f"{rec['grad_norm']:.3f} | {rec['tokens_per_s']:8.0f} tok/s | {rec['step_s'] * 1e3:7.0f} ms | "
                      f"eta {eta:5.0f} s")

    def close(self) -> None:
        """Flush and close everything; again is a no-op (the training loop closes the report
        before the final eval, its cleanup once more however the run ends)."""
        self.metrics.close()
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
            self.tb = None


def _tensorboard(out: Path):
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        raise LoracError("--report-to tensorboard needs tensorboardX: pip install 'lorac[tensorboard]'") from None
    return SummaryWriter(str(out / "runs"))


def compile_all(engine, kinds, progress: str) -> None:
    """Compile (or find in the cache) each graph of the run up front, under a bar on a terminal."""
    if not use_bar(progress):
        for kind in kinds:
            engine.compile(kind)
        return
    from tqdm import tqdm
    log = engine.log
    with tqdm(kinds, unit="graph", desc="compiling", dynamic_ncols=True, file=sys.stderr) as bar:
        engine.log = lambda msg: bar.write(msg, file=sys.stderr)
        try:
            for kind in bar:
                bar.set_postfix_str(kind.split(":")[0])
                engine.compile(kind)
        finally:
            engine.log = log


def data_lines(path, info: dict) -> list[str]:
    """The run's data line, from PackedData.describe() (which summary.json keeps whole), and a
    warning line when rows were left out for want of an answer token."""
    def rows(split, size=""):
        n, left = info[f"{split}_rows"], info[f"{split}_rows_without_answer"]
        return f"{n + left:,} rows{size}" + (f", {n:,} used ({left:,} left out: no answer token)" if left else "")
    seq = info["seq"]
    line = (f"data: {path}: {info['train_docs']:,} documents, {info['train_tokens']:,} tokens "
            f"({info['train_counted']:,} in the loss) -> {rows('train', f' of {seq} tokens')}")
    if info["eval_tokens"]:
        line += f"; eval {info['eval_docs']:,} documents, {rows('eval')}"
    line += f"; packing {info['packing']}"
    if info["truncate"] != "none":
        cut, pad = info["train_prompts_cut"] + info["eval_prompts_cut"], info["train_pad_tokens"] + info["eval_pad_tokens"]
        tokens = max(info["train_tokens"] + info["eval_tokens"], 1)
        line += (f"; {info['truncate']}: {cut:,} prompts cut by "
                 f"{info['train_prompt_tokens_cut'] + info['eval_prompt_tokens_cut']:,} tokens, "
                 f"{pad:,} padding tokens ({pad / tokens:.0%})")
    warning = dropped_rows_warning(info)
    return [line] + ([warning] if warning else [])


def dropped_rows_warning(info: dict, splits=("train", "eval")) -> str | None:
    """One line where rows of `splits` were left out for want of an answer token: how many, why,
    and the fix (PackedData.describe()'s counts)."""
    dropped = [(split, info[f"{split}_rows_without_answer"], info[f"{split}_rows"] + info[f"{split}_rows_without_answer"])
               for split in splits if info[f"{split}_rows_without_answer"]]
    if dropped:
        told = " and ".join(f"{left:,} of {total:,} {'training' if split == 'train' else split} rows ({left / total:.0%})"
                            for split, left, total in dropped)
        if info["truncate"] == "none":
            why = (f"documents longer than --seq {info['seq']} spread over several rows, and their answers see only "
                   "the part of their prompt in their own row; raise --seq, or add --truncate prompt-left (each "
                   "example whole in one row, long prompts cut from the left; docs/DATA.md)")
        else:
            why = (f"documents longer than --seq {info['seq']} even without the prompt before their first answer "
                   "(long later turns of a conversation) spread over several rows; raise --seq")
        return f"warning: {told} hold no answer token and are left out: {why}"
    return None
