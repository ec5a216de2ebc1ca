"""The training loop: step, log, evaluate, checkpoint, and finally export the adapter.

Reads top to bottom, as nanoGPT's train.py: `train` locks OUT and hands over to `_train`,
which loads the run (run.py, after its plan: plan.py), starts fresh or resumes, then steps
(`_step`: forward + backward over the micro-batches, the LoRA+ AdamW update) and logs one
JSON line per step and per eval to OUT/metrics.jsonl and a progress line to the terminal.
"""
from __future__ import annotations

import contextlib
import json
import signal
import time
from pathlib import Path

import numpy as np

from lorac.core import atomic

from ..config import TrainConfig
from ..errors import LoracError
from ..files import respect_umask
from .report import Report, compile_all, skipped_verdict
from .run import Run, graph_kinds, precompile, show_sample

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
LOCK_FILE = ".lorac.lock"  # in OUT: held (flock) by the run writing there


def train(cfg: TrainConfig, log=None) -> dict:
    """Run the whole job; returns a summary dict (also written to OUT/summary.json). The output
    directory is locked for the run: a second run into it fails at once with one line."""
    from .. import dist as distributed
    cfg.validate()
    if cfg.compile_only:
        return precompile(cfg, log)
    workers = distributed.setup(cfg)
    if workers.main:  # before anything is written or trained (outdir.py)
        from .outdir import check_run_dir
        check_run_dir(cfg)
    lock = _claim(Path(cfg.out)) if workers.main else None  # data parallel: only rank 0 writes into OUT
    try:
        # whatever _train opens or installs (the metrics file, the signal handlers) it hands to
        # `cleanup`, which closes and restores it however _train ends
        with contextlib.ExitStack() as cleanup:
            summary = _train(cfg, log, cleanup)
        workers.done = True
        return summary
    finally:
        if lock is not None:
            lock.release()


def _claim(out: Path):
    from lorac.core import locks
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise LoracError(f"cannot create the output directory {out}: {e.strerror or e}") from None
    lock = locks.acquire(out / LOCK_FILE, wait=False)
    if lock is None:
        raise LoracError(f"{out} is in use by another lorac run (pid {locks.holder(out / LOCK_FILE)}); "
                         "wait for it to finish or choose another --out")
    return lock


def _train(cfg: TrainConfig, log, cleanup: contextlib.ExitStack) -> dict:
    from . import resume
    from .optim import group_lrs

    run = Run(cfg, log)
    cfg = run.cfg  # as planned: an --adapter's settings, packing, checkpointing; no eval without an eval set
    log, dp = run.log, run.dp
    out = Path(cfg.out)
    dp.check_identity(run)
    # data parallel: rank 0 reads --resume (or starts fresh) and every worker starts from its state
    st = dp.share_state(run, lambda: run.resume_state(cfg.resume) if cfg.resume else run.fresh_state())
    batches = run.data.batches(cfg.batch, seed=cfg.seed, state=st["data"])  # global batches, dp.shard splits them
    eng = run.engine
    eng.set_state(st["lora"], st["m"], st["v"])
    dp.attach(eng)
    if cfg.resume and dp.main:  # steps after the checkpoint are made again: drop their old lines
        resume.truncate_metrics(out / "metrics.jsonl", st["step"])
    report = cleanup.enter_context(contextlib.closing(
        Report(out, cfg.progress, cfg.report_to, cfg.resume, log) if dp.main else _Silent()))
    log = run.log = eng.log = report.log  # above the progress bar, where there is one
    compile_all(eng, graph_kinds(run.cfg, run.tokenizer, run.eval_path), cfg.progress if dp.main else "lines")
    # Ctrl-C, SIGTERM, SIGHUP: finish the step, save a checkpoint, exit nonzero. The handlers
    # stay until the end: a Ctrl-C inside a compiled call would surface as a TVM error from
    # the GEMM callback rather than as KeyboardInterrupt
    # (data parallel: a signal only marks this worker; the workers agree after each step)
    stop = {"now": False, "signal": None}
    previous = {sig: signal.signal(sig, lambda n, _f: stop.update(now=dp.size == 1, signal=n)) for sig in STOP_SIGNALS}
    cleanup.callback(_restore, previous)
    first_eval = run.evaluate(eng.lora) if cfg.eval_batches else None
    if first_eval is not None:
        if not cfg.resume:
            report.eval(st["step"], first_eval)
        log(f"eval loss before step {st['step'] + 1}: {first_eval:.4f}")
    base_sample = show_sample(run, eng.lora, "base model") if not cfg.resume and dp.main else None
    tokens_per_step = cfg.batch * cfg.seq * cfg.grad_accum
    t_start = time.perf_counter()
    start_step = st["step"]
    gpu_in_use = last_eval = None
    while st["step"] < cfg.steps and not stop["now"]:
        t0 = time.perf_counter()
        st["step"] += 1
        lr_a, lr_b = group_lrs(st["updates"] + 1, run.optim_cfg)
        loss, gnorm, skipped = _step(run, batches, st, lr_a, lr_b)
        loss, agreed = dp.agree(loss, stop["signal"])
        if agreed:
            stop.update(now=True, signal=agreed)
        if skipped:  # a non-finite gradient (a NaN loss makes one too) is never applied
            st["skipped"] += 1
            log(f"step {st['step']}: non-finite loss/gradient (loss {loss}, grad norm {gnorm}); step skipped "
                f"({st['skipped']} so far)")
        else:
            st["updates"] += 1
        dt = time.perf_counter() - t0
        done = st["step"] - start_step
        eta = (time.perf_counter() - t_start) / done * (cfg.steps - st["step"])
        if done == 1 and cfg.backend == "tvm":  # the measured side of the plan's estimate
            in_use = _memory_in_use(run.plan.device, log)
            gpu_in_use = in_use if in_use is not None else gpu_in_use
        report.step(dict(step=st["step"], loss=loss, lr=lr_a, lr_b=lr_b, grad_norm=gnorm, skipped=bool(skipped),
                         tokens_per_s=tokens_per_step / dt, step_s=dt), cfg.steps, eta)
        if cfg.eval_batches and (st["step"] % cfg.eval_every == 0 or st["step"] == cfg.steps):
            ev = last_eval = run.evaluate(eng.lora)
            report.eval(st["step"], ev)
            log(f"eval loss after step {st['step']}: {ev:.4f}")
        if st["step"] % cfg.save_every == 0 or st["step"] == cfg.steps or stop["now"]:
            dp.check_same(eng, st["step"])
            if dp.main:
                path = run.save(st, batches)
                respect_umask(path)
                log(f"checkpoint: {path}")
    report.close()
    interrupted = st["step"] < cfg.steps  # a signal after the last step does not count
    # the last step evaluated already (its LoRA state is the final one) unless the run started there
    final_eval = None if not cfg.eval_batches or interrupted else \
        last_eval if last_eval is not None else run.evaluate(eng.lora)
    if final_eval is not None:
        log(f"eval loss: {first_eval:.4f} before, {final_eval:.4f} after")
    if not dp.main:  # the other workers are done: rank 0 samples, exports and sums up
        return dict(interrupted=interrupted, stopped_by=signal.Signals(stop["signal"]).name if interrupted else None)
    summary = dict(steps=st["step"], updates=st["updates"], skipped=st["skipped"], eval_loss_before=first_eval,
                   eval_loss_after=final_eval, interrupted=interrupted,
                   stopped_by=signal.Signals(stop["signal"]).name if interrupted and stop["signal"] else None,
                   sample_base=base_sample,
                   sample_adapted=show_sample(run, eng.lora, "adapted") if not interrupted else None,
                   data=run.data.describe())
    if gpu_in_use is not None:
        summary["gpu_memory_in_use_gb"] = round(gpu_in_use, 2)
    if hasattr(eng, "describe"):  # what ran: backend, providers, the WebGPU adapter (runtime/engine/ort.py)
        summary["device"] = eng.describe()
    failed = summary["failed"] = None if interrupted else skipped_verdict(st["step"], st["skipped"])
    if not interrupted and not failed:
        from ..export import PeftRefused, export_peft
        from .plot import plot_metrics
        try:
            adapter = export_peft(out / "adapter", eng.state_numpy()[0], alpha=cfg.alpha, use_rslora=cfg.rslora,
                                  base_model_name_or_path=run.source.name, num_hidden_layers=run.spec.layers, warn=log)
            respect_umask(adapter)
        except PeftRefused as e:  # e.g. LoRA on Mamba's out_proj only: the checkpoint exports as merged
            log(f"no PEFT adapter written: {e}")
            adapter = None
        summary["adapter"] = adapter and str(adapter)
        summary["loss_curve"] = str(plot_metrics(out / "metrics.jsonl", out / "loss.png"))
    atomic.write_text(out / "summary.json", json.dumps(summary, indent=1))  # never through a link
    if failed:  # a run that learned nothing does not exit 0 (report.skipped_verdict)
        raise LoracError(f"{failed} (summary: {out / 'summary.json'})")
    return summary


def _restore(handlers: dict) -> None:
    for sig, handler in handlers.items():
        signal.signal(sig, handler)


class _Silent:
    """The report of a data-parallel worker other than rank 0: rank 0 reports for all."""

    def log(self, msg):
        pass

    eval = step = close = lambda self, *a: None


def _step(run: Run, batches, st: dict, lr_a: float, lr_b: float):
    """One optimizer step -> (loss, grad norm, skipped): forward + backward over grad_accum
    micro-batches, gradients averaged, then the LoRA+ AdamW update on the device. Data
    parallel: a worker's loss and gradient count with its share w of each micro-batch's
    tokens, and eng.update sums the workers' gradients (w = 1 in one process)."""
    cfg, eng, dp = run.cfg, run.engine, run.dp
    loss, grads, share = 0.0, None, 1.0
    if cfg.grad_accum == 1:  # gradients stay on the device; the loss is read after the
        batch, share = dp.shard(next(batches))  # update is enqueued
        grads = eng.step(batch, eng.lora, read_loss=False)
        loss = grads.pop("loss")
    for _ in range(cfg.grad_accum if cfg.grad_accum > 1 else 0):
        batch, w = dp.shard(next(batches))
        res = eng.step(batch, eng.lora)
        loss += w * res.pop("loss") / cfg.grad_accum
        part = eng.host(res)  # summed on the host
        part = part if w == 1.0 else {k: np.float32(w) * g for k, g in part.items()}
        grads = part if grads is None else {k: grads[k] + part[k] for k in grads}
    if cfg.grad_accum > 1:
        grads = {k: g / cfg.grad_accum for k, g in grads.items()}
    gnorm, skipped = eng.update(grads, lr_a, lr_b, st["updates"] + 1, grad_share=share)
    if not isinstance(loss, float):
        loss = share * float(loss.numpy())
    return loss, gnorm, skipped


def _memory_in_use(device, log) -> float | None:
    """GB in use on the device after the first step, logged, where the device can tell."""
    info = device.memory_info()
    if not info:
        return None
    gb = (info[1] - info[0]) / 1e9
    log(f"memory: {gb:.1f} GB in use on {device.MEMORY_OF} after the first step (this process and any other)")
    return gb
