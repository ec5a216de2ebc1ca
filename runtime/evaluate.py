"""`lorac eval` and `lorac generate`: the engine of a checkpoint's run (or of the base model),
its graphs planned from the checkpoint's settings (train/saved.py SavedRun, train/plan.py
plan_graphs) and the command's flags, and the token-weighted eval loss over a data file."""
from __future__ import annotations

import json
import sys

from .config import TrainConfig

# the base model (no --checkpoint): rank-1 adapters with B = 0 change nothing; one row a batch
BASE = TrainConfig(batch=1, rank=1, alpha=1.0)


def engine_for(args):
    """(engine, tokenizer, LoRA, model source, the settings planned) for eval/generate: a
    checkpoint's model and LoRA, or the base model."""
    from lorac.graphs import ModelSpec

    from . import limits
    from .engine import make_engine
    from .model.source import resolve_model
    from .train.checkpoint import load_checkpoint
    from .train.plan import plan_graphs
    from .train.saved import SavedRun
    checked = TrainConfig(target=args.target, backend=args.backend, ort_providers=args.ort_providers)
    checked.check_backend()  # --target webgpu: --backend ort (config.py)
    args.target, args.backend = checked.target, checked.backend
    check_positive(args, "batch", "seq")
    lora, saved = None, SavedRun()
    if args.checkpoint:
        ck = load_checkpoint(args.checkpoint, optimizer=False)  # the AdamW moments are not needed here
        lora, saved = ck.lora, SavedRun.of(ck)
    cfg = saved.config(BASE, model=args.model, target=args.target, backend=args.backend, cache_dir=args.cache_dir,
                       ort_providers=args.ort_providers, batch=args.batch, seq=args.seq,
                       packing=getattr(args, "packing", None), truncate=getattr(args, "truncate", None))
    source = resolve_model(cfg.model)
    config, weights, tok = source.load()
    limits.check_context(cfg.seq, config, "--seq")
    if getattr(args, "window", None):
        limits.check_context(args.window, config, "--window")
    plan = plan_graphs(cfg, ModelSpec.from_hf_config(config))
    eng = make_engine(cfg.backend, plan.spec, plan.train, weights, cfg.target, None, cfg.cache_dir,
                      log=lambda m: print(m, file=sys.stderr), providers=cfg.ort_providers)
    if lora is None:  # the base model: rank-1 adapters with B = 0 change nothing
        import numpy as np
        lora = {n: np.zeros(s, np.float32) for n, s in eng.shapes.items()}
    return eng, tok, lora, source, plan.cfg


def check_positive(args, *names) -> None:
    """Flags that default to the checkpoint's value: given, each must be a positive number (0
    or -1 silently meant the default, or an eval over no rows)."""
    from .errors import LoracError
    for name in names:
        v = getattr(args, name, None)
        if v is not None and not v > 0:
            raise LoracError(f"--{name} must be positive, got {v}")


def cmd_eval(args) -> int:
    from .data import load_dataset
    from .train.report import dropped_rows_warning
    eng, tok, lora, _, cfg = engine_for(args)
    data = load_dataset(args.data, tok, eng.train.seq, eng.spec.vocab, eval_fraction=0.0, eval_path=args.data,
                        packing=eng.train.packing, truncate=cfg.truncate)  # --truncate, else the checkpoint's
    if eng.train.packing == "isolated":  # before the eval artifact loads (CUDA sizes its packed attention by it)
        from . import devices
        devices.for_target(cfg.target).reserve_documents(data.max_documents(), data.longest_document())
    warning = dropped_rows_warning(data.describe(), splits=("eval",))
    if warning:
        print(warning, file=sys.stderr)
    total = count = 0.0
    for b in data.eval_batches(eng.train.batch):
        n = float((b["labels"][:, 1:] != -100).sum())
        total += eng.eval_loss(b, lora) * n
        count += n
    if not count:  # a loss over nothing is no 0.0
        from .errors import LoracError
        raise LoracError(f"{args.data}: no token of it counts in the loss at --seq {eng.train.seq}; nothing to evaluate")
    print(json.dumps({"eval_loss": total / count, "tokens": int(count)}))
    return 0


def cmd_generate(args) -> int:
    from .generate import check_sampling, generate, model_repetition_penalty, prompt_ids
    given = args.repetition_penalty  # 0 is a value (refused), not "the model's"
    check_sampling(args.max_new_tokens, args.temperature, args.top_p, args.window, 1.0 if given is None else given,
                   seed=args.seed)
    eng, tok, lora, source, _ = engine_for(args)
    ids = prompt_ids(tok, args.prompt, chat=not args.raw)
    penalty = given if given is not None else model_repetition_penalty(source.path) or 1.0
    new = generate(eng, tok, ids, lora, args.max_new_tokens, args.temperature, args.top_p, args.seed, args.window,
                   penalty)
    print(tok.decode(new))
    return 0
