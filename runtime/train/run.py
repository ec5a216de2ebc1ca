"""Loading a training run: the model, the plan (plan.py), the data and the engine, and the
run's state (fresh, resumed, saved). The loop that steps, logs, evaluates and checkpoints it
is loop.py; `--compile-only` (precompile) reads the weights' shapes from their files' headers
and loads no weight and no data.
"""
from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

from ..config import TrainConfig
from ..errors import LoracError
from .plan import plan_run
from .report import data_lines


def _quantized(weights: dict, log, asked: str | None = None) -> tuple:
    """TrainSpec.quant of the loaded weights (their quantized projections), logged in one line;
    `asked` (--quantize) quantizes only dense weights: where the base's own blocks stay, a
    second line says so."""
    from lorac.graphs.ops.quant import detect
    quant = tuple(sorted(detect(weights).items()))
    if quant:
        kinds = sorted({q.kind for _, q in quant})
        from ..model.quant import quantized_bytes
        size = quantized_bytes(weights)
        log(f"base: {len(quant)} linear weights kept quantized ({', '.join(kinds)}; {size / 1e9:.2f} GB of blocks "
            "and scales), each dequantized just before its GEMMs (--dequantize: dense instead)")
    own = [q.kind for _, q in quant if q.kind != asked]
    if asked and own:
        log(f"base: --quantize {asked} quantized {len(quant) - len(own)} dense linear weights; the {len(own)} the "
            f"model holds quantized already ({', '.join(sorted(set(own)))}) keep their own blocks")
    return quant


def _check_tables(cfg: TrainConfig, source) -> None:
    """--quantize-embeddings nf4|int8 on a model whose tables the format cannot hold: refused from
    its config, before any weight is read."""
    from ..model.quant.embeddings import KINDS, embedding_quant
    if cfg.quantize_embeddings in KINDS:
        from lorac.graphs import ModelSpec
        try:
            spec = ModelSpec.from_hf_config(source.config())
        except ValueError:
            return  # the plan names what the model has that lorac does not implement
        embedding_quant(spec, cfg.quantize_embeddings)


def _keeps(cfg: TrainConfig, source, log) -> bool:
    """cfg.keeps_quantized(), told the base's dense size (from its headers) where auto asks for
    it, and saying so when that keeps a base the device would otherwise dequantize."""
    from ..model.weights import tensor_infos
    asked = []

    def dense_bytes() -> int:
        """float32 bytes (the CPU's dtype: the only device that asks) of every tensor, from the
        headers: a GGUF's as its element counts, a bitsandbytes folder's uint8 4-bit weights two
        values a byte."""
        infos = tensor_infos(source.path)
        asked.append(sum(4 * (2 * i.size if i.dtype == np.uint8 and n.endswith(".weight") else i.size)
                         for n, i in infos.items()))
        return asked[-1]

    keep = cfg.keeps_quantized(dense_bytes)
    if keep and asked:
        log(f"base: kept quantized (--quantized-base auto): held dense its weights would take {asked[0] / 1e9:.1f} GB, "
            f"more than half of this machine's free memory")
    return keep


def kaiming_uniform_a(rng, shape) -> np.ndarray:
    """PEFT's lora_A init, kaiming_uniform_(a=sqrt(5)): bound = sqrt(6/((1+a^2) fan_in)) = 1/sqrt(fan_in)."""
    bound = 1.0 / math.sqrt(shape[1])
    return rng.uniform(-bound, bound, size=shape).astype(np.float32)


def init_lora(shapes: dict, rng) -> dict:
    return {n: kaiming_uniform_a(rng, s) if ".lora_A." in n else np.zeros(s, np.float32) for n, s in shapes.items()}


class Run:
    """Everything a training run holds: model, data, engine, LoRA and optimizer state."""

    def __init__(self, cfg: TrainConfig, log=None):
        from ..data import load_dataset
        from ..dist import current
        from ..engine import make_engine
        from ..model.source import resolve_model
        cfg.validate()
        self.dp = dp = current()  # the data-parallel workers (runtime/dist/); rank 0 alone logs
        self.cfg, self.log = cfg, log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        if not dp.main:
            self.log = lambda msg: None
        self.source = resolve_model(cfg.model)
        self.log(f"model: {self.source.describe()}")
        _check_tables(cfg, self.source)
        self.model_config, weights, self.tokenizer = self.source.load(cfg.quantize, _keeps(cfg, self.source, self.log))
        quant = _quantized(weights, self.log, cfg.quantize)
        from .memory import frozen_sizes
        self.plan, self.adapter = _plan(cfg, self.model_config, frozen_sizes(weights), quant, dp, self.log)
        from ..model.quant.embeddings import quantize_tables
        weights = quantize_tables(weights, self.plan.train.quant)  # --quantize-embeddings, as planned
        self.cfg = cfg = self.plan.cfg
        self.spec, self.train_spec = self.plan.spec, self.plan.train
        data_path, self.eval_path = data_files(cfg)
        self.data = load_dataset(data_path, self.tokenizer, cfg.seq, self.spec.vocab, eval_fraction=cfg.eval_fraction,
                                 eval_path=self.eval_path, packing=cfg.packing, truncate=cfg.truncate)
        for line in data_lines(data_path, self.data.describe()):
            self.log(line)
        if cfg.packing == "isolated":  # before any artifact loads: CUDA sizes its packed attention by it
            self.plan.device.reserve_documents(self.data.max_documents(), self.data.longest_document())
        if cfg.eval_batches and not len(self.data.eval_rows):  # no eval set: no eval loss (never a 0.0)
            self.log("eval: none (--eval-fraction 0 and no --eval-data): no eval loss is computed")
            cfg = self.cfg = replace(cfg, eval_batches=0)
        if cfg.eval_batches and not len(self.data.eval_rows):  # no eval set: no eval loss (never a 0.0)
            self.log("eval: none (--eval-fraction 0 and no --eval-data): no eval loss is computed")
            cfg = self.cfg = replace(cfg, eval_batches=0)
        self.optim_cfg = cfg.optim_config()
        device = self.plan.device
        info = device.gemm_info() if cfg.backend == "tvm" and not cfg.compile_only else None
        if info:
            self.log(f"{device.NAME} GEMMs: {info}")
        self.engine = make_engine(cfg.backend, self.spec, self.train_spec, weights, cfg.target, cfg.dtype,
                                  cfg.cache_dir, self.optim_cfg, self.log, cuda_graph=not cfg.no_cuda_graph,
                                  providers=cfg.ort_providers, ranks=self.plan.workers, tune=cfg.tune,
                                  host_tables=host_tables(cfg, self.spec))
        del weights  # the device holds them now
        if self.adapter:
            self.adapter.check_shapes(self.engine.shapes)
        self.model_hash = _model_hash(self.model_config, self.source.path)

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
        from .saved import SavedRun
        ck = load_checkpoint(path, model_hash=self.model_hash, graph_hash=self.engine.graph_hash)
        s = ck.state
        if set(ck.lora) != set(self.engine.names):
            raise LoracError(f"checkpoint {ck.path} holds other LoRA tensors than this run trains")
        lacking = [k for k in ("updates", "skipped", "data", "rng") if k not in s]
        if lacking:
            raise LoracError(f"checkpoint {ck.path} cannot be resumed: its state has no {lacking[0]}")
        saved = SavedRun.of(ck)
        resume.check(saved, self.cfg, self.data.digest)
        self.optim_cfg.total_steps = resume.schedule_steps(saved, self.cfg, self.log)
        return dict(step=ck.step, updates=s["updates"], skipped=s["skipped"], lora=ck.lora, m=ck.m, v=ck.v,
                    data=s["data"], rng=rng_from_state(s["rng"]))

    def save(self, st: dict, batches) -> Path:
        from .checkpoint import rng_state, save_checkpoint
        lora, m, v = self.engine.state_numpy()
        state = dict(updates=st["updates"], skipped=st["skipped"], data=batches.state(), rng=rng_state(st["rng"]),
                     model_hash=self.model_hash, graph_hash=self.engine.graph_hash, data_sha256=self.data.digest,
                     schedule_steps=self.optim_cfg.total_steps, train_config=_jsonable(asdict(self.cfg)),
                     model_config=self.model_config)
        if hasattr(self.engine, "describe"):  # what trained it: backend, providers, the WebGPU adapter
            state["device"] = _jsonable(self.engine.describe())
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


def _plan(cfg: TrainConfig, model_config: dict, frozen: tuple[int, int], quant: tuple, dp, log):
    """(the run's Plan, the --adapter read or None): reads the adapter and the --resume
    checkpoint's settings, the two files the plan takes besides the model's config and the
    frozen weights' sizes and quantized layout (`quant`: TrainSpec.quant)."""
    from lorac.graphs import ModelSpec
    spec = ModelSpec.from_hf_config(model_config)
    adapter = None
    if cfg.adapter:  # the adapter's settings replace the flags it decides
        from ..model.adapter_in import read_adapter
        adapter = read_adapter(cfg.adapter, spec)
        log(f"adapter: {adapter.describe()}")
    saved = None
    if cfg.resume and "auto" in (cfg.checkpointing, cfg.quantize_embeddings):  # the checkpoint's graph
        from .saved import SavedRun
        saved = SavedRun.read(cfg.resume)
    return plan_run(cfg, spec, model_config, frozen, quant=quant, adapter=adapter, saved=saved, dp=dp,
                    log=log), adapter


def data_files(cfg: TrainConfig) -> tuple[str, str | None]:
    """(training data, eval data): --data and --eval-data, else the bundled corpus."""
    return (cfg.data, cfg.eval_data) if cfg.data else default_corpus()


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


def _sample_ids(cfg: TrainConfig, tokenizer, eval_path):
    """(prompt, its token ids) of the before/after sample, or (None, None) when there is none."""
    from ..generate import prompt_ids
    prompt = sample_prompt(cfg, eval_path)
    if not prompt or cfg.sample_tokens <= 0:
        return None, None
    return prompt, prompt_ids(tokenizer, prompt)


def show_sample(run, lora, label: str) -> str | None:
    from ..generate import SAMPLE_REPETITION_PENALTY, generate, model_repetition_penalty
    prompt, ids = _sample_ids(run.cfg, run.tokenizer, run.eval_path)
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


def host_tables(cfg: TrainConfig, spec) -> tuple:
    """The tables the engine holds in host memory, as the plan resolved --offload-embeddings."""
    from .memory import host_table
    return (host_table(spec),) if cfg.offload_embeddings == "on" else ()


def _model_hash(config: dict, path) -> str:
    """The model's identity for --resume: its config and its weights' fingerprint."""
    from .checkpoint import config_hash
    from ..model.weights import fingerprint
    return config_hash({"config": {k: v for k, v in config.items() if not k.startswith("_")},
                        "weights": fingerprint(path)})


def _jsonable(x):
    return json.loads(json.dumps(x, default=str))


def graph_kinds(cfg: TrainConfig, tokenizer, eval_path) -> list[str]:
    """The graphs a run uses (Engine.compile's kinds)."""
    kinds = ["train", "adamw"] + (["eval"] if cfg.eval_batches else [])
    _, ids = _sample_ids(cfg, tokenizer, eval_path)
    if ids is not None:
        kinds.append(f"forward:1,{_window(len(ids), cfg)}")
    return kinds


def precompile(cfg: TrainConfig, log=None) -> dict:
    """Compile every graph the run would use into the cache (compile here, train elsewhere):
    the plan from the model's config and its weights' shapes (file headers), no weight or
    training data loaded. A base the run keeps quantized is the exception: its layout comes
    from loading it (weights.holds_quantized)."""
    from ..dist import current
    from ..engine import make_engine
    from ..model.source import resolve_model
    from ..model.tokenizer import load_tokenizer
    from ..model.weights import frozen_sizes_of, holds_quantized
    from .memory import frozen_sizes
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    source = resolve_model(cfg.model)
    log(f"model: {source.describe()}")
    config = source.config()
    if cfg.quantize or (holds_quantized(source.path, config) and _keeps(cfg, source, log)):
        config, weights, _ = source.load(cfg.quantize, True)
        frozen, quant = frozen_sizes(weights), _quantized(weights, log, cfg.quantize)
        del weights
    else:
        frozen, quant = frozen_sizes_of(source.path), ()
    plan, adapter = _plan(cfg, config, frozen, quant, current(), log)
    engine = make_engine(cfg.backend, plan.spec, plan.train, None, cfg.target, cfg.dtype, cfg.cache_dir,
                         cfg.optim_config(), log, cuda_graph=not cfg.no_cuda_graph, ranks=plan.workers, tune=cfg.tune)
    if adapter:
        adapter.check_shapes(engine.shapes)
    kinds = graph_kinds(plan.cfg, load_tokenizer(source.path), data_files(cfg)[1])
    arts = {k: str(engine.compile(k)) for k in kinds}
    log(f"compiled {len(arts)} artifacts for {cfg.target} into {cfg.cache_dir}")
    return {"compiled": arts}
