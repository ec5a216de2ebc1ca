"""The training loop: model + data + compiled step -> a trained LoRA adapter.

Reads top to bottom: load the model and data, compile (or reuse) the graphs, initialise or
resume, then step / log / eval / checkpoint, and finally export the adapter. One JSON line
per step and per eval goes to OUT/metrics.jsonl; a progress line goes to the terminal.
"""
from __future__ import annotations

import contextlib
import json
import math
import signal
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

from lorac.core import atomic

from .. import devices
from ..errors import LoracError
from ..files import respect_umask
from ..config import CPU, TrainConfig
from .report import Report, compile_all, data_lines, skipped_verdict

def resolve_packing(packing: str | None, spec, target: str = CPU) -> str:
    """--packing auto (or None) -> "isolated" where the model family implements it and the
    target runs it at plain packing's cost; "plain" for Mamba (its conv and scan would need
    their state reset at document starts: not implemented) and on cuda, where the packed
    attention is not yet on cuDNN (TVM kernels: ~4x the attention time and O(S^2) memory)."""
    if packing in (None, "auto"):
        from lorac.graphs.families import for_spec
        return "isolated" if for_spec(spec).PACKING_ISOLATED and target != "cuda" else "plain"
    return packing


def _quantized(weights: dict, log) -> tuple:
    """TrainSpec.quant of the loaded weights (their quantized projections), logged in one line."""
    from lorac.graphs.quant import detect
    quant = tuple(sorted(detect(weights).items()))
    if quant:
        kinds = sorted({q.kind for _, q in quant})
        size = sum(w.nbytes for n, w in weights.items() if ".weight." in n)
        log(f"base: {len(quant)} linear weights kept quantized ({', '.join(kinds)}; {size / 1e9:.2f} GB of blocks "
            "and scales), each dequantized just before its GEMMs (--dequantize: dense instead)")
    return quant


def kaiming_uniform_a(rng, shape) -> np.ndarray:
    """PEFT's lora_A init, kaiming_uniform_(a=sqrt(5)): bound = sqrt(6/((1+a^2) fan_in)) = 1/sqrt(fan_in)."""
    bound = 1.0 / math.sqrt(shape[1])
    return rng.uniform(-bound, bound, size=shape).astype(np.float32)


def init_lora(shapes: dict, rng) -> dict:
    return {n: kaiming_uniform_a(rng, s) if ".lora_A." in n else np.zeros(s, np.float32) for n, s in shapes.items()}


class Run:
    """Everything a training run holds: model, data, engine, LoRA and optimizer state."""

    def __init__(self, cfg: TrainConfig, log=None):
        from lorac.graphs import ModelSpec, TrainSpec

        from ..data import load_dataset
        from ..model.source import resolve_model
        from ..dist import current
        cfg.validate()
        self.dp = dp = current()  # the data-parallel workers (runtime/dist/__init__.py); rank 0 alone logs
        self.cfg, self.log = cfg, log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        if not dp.main:
            self.log = lambda msg: None
        self.source = resolve_model(cfg.model)
        self.log(f"model: {self.source.describe()}")
        self.model_config, weights, self.tokenizer = self.source.load(cfg.quantize, cfg.keeps_quantized())
        self.spec = ModelSpec.from_hf_config(self.model_config)
        quant = _quantized(weights, self.log)
        self.adapter = None
        if cfg.adapter:  # the adapter's settings replace the flags it decides
            from ..model.adapter_in import read_adapter
            self.adapter = a = read_adapter(cfg.adapter, self.spec)
            cfg = self.cfg = replace(cfg, rank=a.rank, alpha=a.alpha, rslora=a.rslora, lora_targets=a.targets,
                                     trained_layers=a.trained_layers(self.spec.layers))
            cfg.check_bounds()  # the adapter's alpha, as --alpha's
            self.log(f"adapter: {a.describe()}")
        packing = resolve_packing(cfg.packing, self.spec, cfg.target)
        if packing != cfg.packing:  # checkpoints record what ran
            cfg = self.cfg = replace(cfg, packing=packing)
        why = " (documents attend only within themselves)" if packing == "isolated" else " (rows attend across documents)"
        if packing == "isolated" and cfg.target == "cuda":
            why += "; attention runs as TVM kernels, not cuDNN's (docs/COMPILER.md)"
        self.log(f"packing: {packing}{why}")
        from lorac.graphs.families import for_spec
        try:  # the family's own options (Mamba's scan chunk)
            extra = for_spec(self.spec).train_extra(cfg.target, cfg.scan_chunk)
        except ValueError as e:
            raise LoracError(str(e)) from None
        if "scan_chunk" in extra:
            self.log(f"mamba scan chunk: {extra['scan_chunk']}" + ("" if cfg.scan_chunk else f" ({cfg.target} default)"))
        # data parallel: each worker's step takes its share of the global --batch (--compile-only
        # --gpus N, in one process, compiles that step too)
        workers = dp.size if dp.size > 1 else max(cfg.gpus, 1)
        loss_chunk = cfg.loss_chunk
        budget = getattr(devices.for_target(cfg.target), "LOSS_CHUNK_BYTES", None)
        if loss_chunk == 0 and budget:  # bound the [tokens, vocab] logits on GPUs
            from lorac.graphs.loss import auto_chunk
            loss_chunk = auto_chunk(self.spec.vocab, cfg.batch // workers * cfg.seq, budget)
            if loss_chunk:
                self.log(f"loss chunk: {loss_chunk} tokens ({cfg.target} default: fp32 logits of a chunk <= "
                         f"{budget / 2**30:g} GiB)")
        self.train_spec = TrainSpec(batch=cfg.batch // workers, seq=cfg.seq, lora_targets=tuple(cfg.lora_targets or self.spec.targets), rank=cfg.rank,
                                    alpha=cfg.alpha, rslora=cfg.rslora, trained_layers=cfg.layer_range(self.spec.layers),
                                    checkpointing=cfg.checkpointing in ("on", "offload"),
                                    offload=cfg.checkpointing == "offload", keep_layers=cfg.keep_layers, loss_chunk=loss_chunk,
                                    packing=cfg.packing, quant=quant, extra=extra)
        from .memory import frozen_sizes
        n_weights, packed = frozen_sizes(weights)
        if cfg.checkpointing == "auto":
            self._choose_checkpointing(n_weights, packed)
            cfg = self.cfg
        self.train_spec.validate(self.spec)
        from .. import limits  # before any compile: an impossible size would only fill memory
        limits.check_context(cfg.seq, self.model_config, "--seq")
        limits.check_rank(self.spec, self.train_spec)
        limits.check_memory(self.spec, self.train_spec, n_weights, cfg.target, packed)
        data_path, eval_path = (cfg.data, cfg.eval_data) if cfg.data else default_corpus()
        self.data = load_dataset(data_path, self.tokenizer, cfg.seq, self.spec.vocab, eval_fraction=cfg.eval_fraction,
                                 eval_path=eval_path, packing=cfg.packing, truncate=cfg.truncate)
        self.eval_path = eval_path
        for line in data_lines(data_path, self.data.describe()):
            self.log(line)
        if cfg.eval_batches and not len(self.data.eval_rows):  # no eval set: no eval loss (never a 0.0)
            self.log("eval: none (--eval-fraction 0 and no --eval-data): no eval loss is computed")
            cfg = self.cfg = replace(cfg, eval_batches=0)
        self.optim_cfg = cfg.optim_config()
        from ..engine import make_engine
        if cfg.target == "cpu" and cfg.backend == "tvm" and not cfg.compile_only:
            from ..devices.cpu.blas import blas_info
            self.log(f"cpu GEMMs: {blas_info()}")
        self.engine = make_engine(cfg.backend, self.spec, self.train_spec, weights, cfg.target, cfg.dtype,
                                  cfg.cache_dir, self.optim_cfg, self.log, cuda_graph=not cfg.no_cuda_graph,
                                  providers=cfg.ort_providers, ranks=workers, tune=cfg.tune)
        del weights  # the device holds them now
        if self.adapter:
            self.adapter.check_shapes(self.engine.shapes)
        self.model_hash = _model_hash(self.model_config, self.source.path)

    def _choose_checkpointing(self, n_weights: int, packed: int = 0) -> None:
        """Resolve --checkpointing auto (runtime/train/memory.py) into on/off and --keep-layers,
        in the config too (checkpoints record what ran; a resumed run compiles the same graph)."""
        from . import memory as step_memory
        cfg, train, log = self.cfg, self.train_spec, self.log
        off = False
        if cfg.resume:  # the checkpoint's graph
            from .checkpoint import read_state
            saved = read_state(cfg.resume).get("train_config") or {}
            ckpt, keep = saved.get("checkpointing", False), int(saved.get("keep_layers") or 0)
            off = ckpt == "offload"
            ckpt = ckpt if isinstance(ckpt, bool) else ckpt in ("on", "offload")
            why = f"the checkpoint's setting ({cfg.resume})"
        elif cfg.keep_layers:
            ckpt, keep, why = True, cfg.keep_layers, "--keep-layers given"
        elif cfg.target != "cuda" or cfg.backend != "tvm":
            ckpt, keep, why = False, 0, f"auto is off on --target {cfg.target}" if cfg.backend == "tvm" else \
                "auto is off on --backend ort"
        else:
            device = devices.for_target(cfg.target)
            free = None if cfg.memory_budget is not None else device.memory_free()
            budget, source = step_memory.budget_from(free, cfg.memory_budget)
            gather = getattr(self.dp, "gather", None)
            if gather is not None and budget is not None:  # every worker compiles the same step
                budget = int(gather([budget], "the memory budgets").min())
                source += f", the least of {self.dp.size} workers"
            dtype = cfg.dtype or device.DEFAULT_DTYPE
            choice = step_memory.choose(self.spec, train, n_weights, dtype, budget, source, packed,
                                        offload=getattr(device, "OFFLOADS", False))
            ckpt, keep, off, why = choice.checkpointing, choice.keep_layers, choice.offload, choice.why
        off = off and ckpt
        self.train_spec = replace(train, checkpointing=ckpt, keep_layers=keep if ckpt else 0, offload=off)
        self.cfg = replace(cfg, checkpointing="offload" if off else "on" if ckpt else "off", keep_layers=keep if ckpt else 0)
        log(f"memory: auto: {step_memory.describe(ckpt, keep, len(train.layers(self.spec)), off)} ({why})")

    # -- state ------------------------------------------------------------------------------
    def fresh_state(self):
        rng = np.random.default_rng(self.cfg.seed)
        lora = init_lora(self.engine.shapes, rng) if self.adapter is None else \
            {n: self.adapter.lora[n].copy() for n in self.engine.shapes}
        zeros = {n: np.zeros(s, np.float32) for n, s in self.engine.shapes.items()}
        return dict(step=0, updates=0, skipped=0, lora=lora, m=zeros, v=dict(zeros), data=None, rng=rng)

    def resume_state(self, path):
        from . import resume
        from .checkpoint import load_checkpoint, rng_from_state
        ck = load_checkpoint(path, model_hash=self.model_hash, graph_hash=self.engine.graph_hash)
        s = ck.state
        if set(ck.lora) != set(self.engine.names):
            raise LoracError(f"checkpoint {ck.path} holds other LoRA tensors than this run trains")
        lacking = [k for k in ("updates", "skipped", "data", "rng") if k not in s]
        if lacking:
            raise LoracError(f"checkpoint {ck.path} cannot be resumed: its state has no {lacking[0]}")
        resume.check(ck, self.cfg, self.data.digest)
        self.optim_cfg.total_steps = resume.schedule_steps(ck, self.cfg, self.log)
        return dict(step=ck.step, updates=s["updates"], skipped=s["skipped"], lora=ck.lora, m=ck.m, v=ck.v,
                    data=s["data"], rng=rng_from_state(s["rng"]))

    def save(self, st: dict, batches) -> Path:
        from .checkpoint import rng_state, save_checkpoint
        lora, m, v = self.engine.state_numpy()
        state = dict(updates=st["updates"], skipped=st["skipped"], data=batches.state(), rng=rng_state(st["rng"]),
                     model_hash=self.model_hash, graph_hash=self.engine.graph_hash, data_sha256=self.data.digest,
                     schedule_steps=self.optim_cfg.total_steps, train_config=_jsonable(asdict(self.cfg)),
                     model_config=self.model_config)
        return save_checkpoint(Path(self.cfg.out) / "checkpoints", st["step"], lora, m, v, state,
                               keep=self.cfg.keep_checkpoints)

    def evaluate(self, lora) -> float:
        """Mean loss over the first `eval_batches` eval batches (token-weighted; each worker
        scores its rows of every batch)."""
        total = count = 0.0
        for i, b in enumerate(self.data.eval_batches(self.cfg.batch)):
            if i >= self.cfg.eval_batches:
                break
            b, _ = self.dp.shard(b)
            n = float(np.sum(b["labels"][:, 1:] != -100))
            total += self.engine.eval_loss(b, lora) * n
            count += n
        total, count = self.dp.total([total, count])
        return total / max(count, 1.0)


def default_corpus() -> tuple[str, str]:
    from ..model.default import default_corpus as files
    return files()


def sample_prompt(cfg: TrainConfig, eval_path) -> str | None:
    """The before/after sample's prompt: --sample-prompt, else the first user turn or prompt of
    the eval file (JSONL), else none."""
    if cfg.sample_prompt:
        return cfg.sample_prompt
    if not eval_path or not str(eval_path).endswith(".jsonl"):
        return None
    from ..data import read_records
    rec = next((r for _, r in read_records(eval_path)), {})  # the loader's reading: blank lines skipped
    if isinstance(rec.get("prompt"), str):
        return rec["prompt"]
    users = [m["content"] for m in rec.get("messages") or [] if isinstance(m, dict) and m.get("role") == "user"]
    return users[0] if users and isinstance(users[0], str) else None


def _sample_ids(run):
    """Token ids of the before/after sample's prompt, or None when there is no sample."""
    from ..generate import prompt_ids
    prompt = sample_prompt(run.cfg, run.eval_path)
    if not prompt or run.cfg.sample_tokens <= 0:
        return None, None
    return prompt, prompt_ids(run.tokenizer, prompt)


def show_sample(run, lora, label: str) -> str | None:
    from ..generate import SAMPLE_REPETITION_PENALTY, generate, model_repetition_penalty
    prompt, ids = _sample_ids(run)
    if prompt is None:
        return None
    tok = run.tokenizer
    penalty = model_repetition_penalty(run.source.path) or SAMPLE_REPETITION_PENALTY
    text = tok.decode(generate(run.engine, tok, ids, lora, run.cfg.sample_tokens, window=_window(len(ids), run.cfg),
                               repetition_penalty=penalty))
    run.log(f"--- sample ({label}) ---\n> {prompt}\n{text}\n---")
    return text


def _window(n_prompt: int, cfg: TrainConfig) -> int:
    """Forward-graph window for a sample: prompt plus new tokens, rounded up to 32."""
    return -(-(n_prompt + cfg.sample_tokens) // 32) * 32


def _model_hash(config: dict, path) -> str:
    """The model's identity for --resume: its config and its weights' fingerprint."""
    from .checkpoint import config_hash
    from ..model.weights import fingerprint
    return config_hash({"config": {k: v for k, v in config.items() if not k.startswith("_")},
                        "weights": fingerprint(path)})


def _jsonable(x):
    return json.loads(json.dumps(x, default=str))


def graph_kinds(run: Run) -> list[str]:
    """The graphs the run uses (Engine.compile's kinds)."""
    kinds = ["train", "adamw"] + (["eval"] if run.cfg.eval_batches else [])
    _, ids = _sample_ids(run)
    if ids is not None:
        kinds.append(f"forward:1,{_window(len(ids), run.cfg)}")
    return kinds


def precompile(run: Run) -> dict:
    """Compile every graph the run would use into the cache (compile here, train elsewhere)."""
    arts = {k: str(run.engine.compile(k)) for k in graph_kinds(run)}
    run.log(f"compiled {len(arts)} artifacts for {run.cfg.target} into {run.cfg.cache_dir}")
    return {"compiled": arts}


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
LOCK_FILE = ".lorac.lock"  # in OUT: held (flock) by the run writing there


def train(cfg: TrainConfig, log=None) -> dict:
    """Run the whole job; returns a summary dict (also written to OUT/summary.json). The output
    directory is locked for the run: a second run into it fails at once with one line."""
    from .. import dist as distributed
    cfg.validate()
    if cfg.compile_only:
        return precompile(Run(cfg, log))
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
    cfg = run.cfg  # as resolved: packing, checkpointing, an adapter's settings, no eval without an eval set
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
    compile_all(eng, graph_kinds(run), cfg.progress if dp.main else "lines")
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
    gpu_in_use = None
    while st["step"] < cfg.steps and not stop["now"]:
        t0 = time.perf_counter()
        st["step"] += 1
        lr_a, lr_b = group_lrs(st["updates"] + 1, run.optim_cfg)
        # forward + backward over grad_accum micro-batches; gradients averaged. Data parallel: a
        # worker's loss and gradient count with its share w of each micro-batch's tokens, and
        # eng.update sums the workers' gradients (w = 1 in one process)
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
        if done == 1 and cfg.target == "cuda" and cfg.backend == "tvm":  # the measured side of the plan's estimate
            from ..limits import gpu_memory_info
            info = gpu_memory_info()
            if info:
                gpu_in_use = (info[1] - info[0]) / 1e9
                log(f"memory: {gpu_in_use:.1f} GB in use on the GPU after the first step (this process and any other)")
        report.step(dict(step=st["step"], loss=loss, lr=lr_a, lr_b=lr_b, grad_norm=gnorm, skipped=bool(skipped),
                         tokens_per_s=tokens_per_step / dt, step_s=dt), cfg.steps, eta)
        if cfg.eval_batches and (st["step"] % cfg.eval_every == 0 or st["step"] == cfg.steps):
            ev = run.evaluate(eng.lora)
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
    final_eval = run.evaluate(eng.lora) if cfg.eval_batches and not interrupted else None
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
