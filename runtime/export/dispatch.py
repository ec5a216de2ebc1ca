"""`lorac export`: a checkpoint's adapter in the format asked for (PEFT directory, merged HF
directory, GGUF LoRA file, merged GGUF), or the ONNX graph of a model or a checkpoint's run.
A new export format is a branch here and its writer beside this file."""
from __future__ import annotations

import sys

from ..config import TrainConfig
from ..errors import LoracError
from ..files import respect_umask

FORMATS = ("peft", "merged", "gguf", "gguf-merged", "onnx")
# --format onnx without a checkpoint: one row, TrainConfig's other defaults, no packed documents
ONNX_DEFAULTS = TrainConfig(batch=1, packing="plain")


def cmd_export(args) -> int:
    from . import export_gguf, export_merged, export_merged_weights, export_peft
    from ..model.source import resolve_model
    from ..model.weights import holds_quantized
    from ..train.checkpoint import load_checkpoint
    from ..train.saved import SavedRun
    from .output import check_destination
    if args.format == "onnx":
        return export_onnx_graph(args)
    if not args.checkpoint:
        raise LoracError(f"--format {args.format} exports a trained adapter: give --checkpoint")
    ck = load_checkpoint(args.checkpoint, optimizer=False)  # the AdamW moments are not exported
    saved = SavedRun.of(ck)
    alpha, rslora, config = saved.alpha, saved.rslora, saved.model_config
    source = resolve_model(args.model or saved.model)
    if args.dtype in ("q8_0", "base") and args.format != "gguf-merged":
        raise LoracError(f"--dtype {args.dtype} is for --format gguf-merged")
    check_destination(args.out, [source.path, ck.path, args.checkpoint])  # never over what it reads
    if args.format == "peft":
        path = export_peft(args.out, ck.lora, alpha=alpha, use_rslora=rslora, base_model_name_or_path=source.name,
                           num_hidden_layers=config.get("num_hidden_layers"), warn=lambda m: print(m, file=sys.stderr))
    elif args.format == "merged" and source.path.is_dir() and holds_quantized(source.path, source.config()):
        # a bitsandbytes NF4 base: its weights dequantized through lorac's reference (bit for bit
        # bitsandbytes' dequantize_4bit), merged, written dense (no quantization_config)
        config, weights, tok = source.load()
        config = {k: v for k, v in config.items() if k != "quantization_config"}
        print(f"the base {source.path} is quantized (bitsandbytes NF4): merging into its dequantized weights",
              file=sys.stderr)
        path = export_merged_weights(args.out, weights, config, ck.lora, alpha=alpha, use_rslora=rslora,
                                     tokenizer=tok, dtype=args.dtype or "bfloat16")
    elif args.format == "merged" and source.path.is_dir():
        path = export_merged(args.out, source.path, ck.lora, alpha=alpha, use_rslora=rslora, dtype=args.dtype)
    elif args.format == "merged":  # a GGUF base: merge into its dequantized weights, write an HF directory
        from ..model.gguf import float_dtype
        config, weights, tok = source.load()
        path = export_merged_weights(args.out, weights, config, ck.lora, alpha=alpha, use_rslora=rslora,
                                     tokenizer=tok, dtype=args.dtype or float_dtype(source.path))
    elif args.format == "gguf-merged":
        from .gguf_merged import export_gguf_merged
        qtype = {"float16": "F16", "bfloat16": "BF16", "float32": "F32", "q8_0": "Q8_0", "base": "BASE"}[args.dtype or "float16"]
        path = export_gguf_merged(args.out, source.path, ck.lora, alpha=alpha, use_rslora=rslora, qtype=qtype,
                                  warn=lambda m: print(m, file=sys.stderr))
    else:
        path = export_gguf(args.out, ck.lora, alpha=alpha, model_config=config, use_rslora=rslora)
    respect_umask(path)
    print(f"exported {args.format} to {path}")
    return 0


def export_onnx_graph(args) -> int:
    """The training/eval/forward graph of --checkpoint's run (its settings, no tensor read), or
    of --model with the given settings; the model's config alone, no weights."""
    from lorac.graphs import ModelSpec

    from ..evaluate import check_positive
    from ..model.source import resolve_model
    from ..train.plan import plan_graphs
    from ..train.saved import SavedRun
    from .onnx import export_onnx
    check_positive(args, "batch", "seq", "rank", "alpha")
    targets = [t.strip() for t in args.targets.split(",") if t.strip()] if args.targets is not None else None
    if targets == []:
        raise LoracError(f"--targets {args.targets!r} names no LoRA target (leave it out for every linear layer)")
    saved = SavedRun.read(args.checkpoint) if args.checkpoint else SavedRun()
    cfg = saved.config(ONNX_DEFAULTS, model=args.model, batch=args.batch, seq=args.seq, rank=args.rank,
                       alpha=args.alpha, lora_targets=tuple(targets) if targets else None, packing=args.packing)
    config = resolve_model(cfg.model).config()
    train = plan_graphs(cfg, ModelSpec.from_hf_config(config)).train
    path = export_onnx(args.out, config, train, args.graph)
    respect_umask(path)
    print(f"exported the {args.graph} graph ({train.batch}x{train.seq}, rank {train.rank}) to {path}")
    return 0
