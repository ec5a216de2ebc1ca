"""OUT/loss.png: train loss per step, eval loss at each eval (points), and the learning rate
on a second axis, drawn with matplotlib's object API (no pyplot: the process's backend and
any open figures stay as they were)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def read_metrics(metrics_path):
    """(train [(step, loss, lr)], eval [(step, loss)]) from metrics.jsonl, finite values only."""
    train, evals = [], []
    for line in Path(metrics_path).read_text().splitlines():
        r = json.loads(line)
        if "loss" in r and np.isfinite(r["loss"]):
            train.append((r["step"], r["loss"], r.get("lr", np.nan)))
        if "eval_loss" in r and np.isfinite(r["eval_loss"]):
            evals.append((r["step"], r["eval_loss"]))
    return train, evals


def plot_metrics(metrics_path, png_path) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    train, evals = read_metrics(metrics_path)
    fig = Figure(figsize=(7.2, 4.0), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    if train:
        steps, loss, lr = zip(*train)
        ax.plot(steps, loss, color="tab:blue", linewidth=1.2, label="train loss")
        lr_ax = ax.twinx()
        lr_ax.plot(steps, lr, color="tab:gray", linestyle="--", linewidth=1.0, label="learning rate")
        lr_ax.set_ylabel("learning rate (A; B: x LoRA+ ratio)")
        lr_ax.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
        lr_ax.set_ylim(bottom=0)
    if evals:
        steps, loss = zip(*evals)
        ax.plot(steps, loss, color="tab:red", marker="o", linewidth=1.0, label="eval loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(True, alpha=0.3)
    handles = ax.get_legend_handles_labels()
    if train:
        more = lr_ax.get_legend_handles_labels()
        handles = (handles[0] + more[0], handles[1] + more[1])
    if handles[0]:
        ax.legend(*handles, loc="upper right")
    fig.tight_layout()
    from lorac.core.atomic import replacing
    with replacing(png_path, suffix=".png") as tmp:  # renamed over the name: never drawn through a link
        fig.savefig(str(tmp), format="png")
    return Path(png_path)
