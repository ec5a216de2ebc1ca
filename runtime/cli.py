"""`lorac compile | train | eval | generate | export`.

Every train setting is a flag; `--config FILE.toml` supplies defaults for them (keys are
the flag names with dashes or underscores), and flags given on the command line win.
Bad input ends with one line on stderr and exit code 2; nothing half-written is left.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import MISSING, fields

from lorac.core.settings import help_of

from . import devices
from .errors import LoracError
from .config import TrainConfig
from .evaluate import cmd_eval, cmd_generate
from .export.dispatch import FORMATS, cmd_export
from .export.onnx import GRAPHS

# the spellings of TRL's SFTConfig / transformers' TrainingArguments and PEFT's LoraConfig, as
# aliases (any flag may also be written with underscores: --learning_rate)
DEFAULTS = TrainConfig()  # the defaults of every command's shared settings (eval, generate, export)


ALIASES = {"lr": "--learning-rate", "steps": "--max-steps", "rank": "--lora-r", "alpha": "--lora-alpha",
           "rslora": "--use-rslora", "seq": "--max-seq-length", "batch": "--per-device-train-batch-size",
           "grad_accum": "--gradient-accumulation-steps", "out": "--output-dir", "warmup": "--warmup-steps",
           "lora_targets": "--target-modules", "eval_every": "--eval-steps", "save_every": "--save-steps",
           "keep_checkpoints": "--save-total-limit"}


class _BatchSpelling(argparse.Action):
    """--batch is the global batch; TRL's --per-device-train-batch-size is per worker (train_config
    multiplies it by the number of data-parallel workers)."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        namespace.batch_per_device = option_string == ALIASES["batch"]


def flag_of(f) -> str:
    """A TrainConfig field's flag: its name with dashes, unless the field names another."""
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def _add_train_flags(p: argparse.ArgumentParser) -> None:
    """One flag per TrainConfig field, help text and default from the field itself."""
    p.add_argument("--config", help="TOML file with defaults for any of these flags")
    for f in fields(TrainConfig):
        if f.name == "extra":
            continue
        flags = [flag_of(f)] + ([ALIASES[f.name]] if f.name in ALIASES else [])
        default = f.default if f.default is not MISSING else None
        help_ = f.metadata.get("help", "")
        if isinstance(default, bool):
            p.add_argument(*flags, dest=f.name, action="store_true", default=None, help=help_)
        elif "bare" in f.metadata:  # a value, or the flag alone for f.metadata["bare"]
            p.add_argument(*flags, dest=f.name, nargs="?", const=f.metadata["bare"], default=None,
                           help=help_ + f"; the flag alone: {f.metadata['bare']} (default: {default})")
        elif f.name in ("lora_targets", "trained_layers"):
            p.add_argument(*flags, dest=f.name, default=None, help=help_, metavar=flag_of(f)[2:].upper().replace("-", "_"))
        else:
            kind = f.metadata.get("type") or (type(default) if default is not None else str)
            shown = f" (default: {default})" if default is not None else ""
            p.add_argument(*flags, dest=f.name, type=kind, default=None, help=help_ + shown,
                           **({"action": _BatchSpelling} if f.name == "batch" else {}))


def _field(key: str) -> str:
    """A TOML key (field, flag name or alias, dashes or underscores) -> its TrainConfig field."""
    flag = "--" + key.replace("_", "-")
    by_flag = {flag_of(f): f.name for f in fields(TrainConfig)} | {alias: name for name, alias in ALIASES.items()}
    return by_flag.get(flag, key.replace("-", "_"))


def train_config(args: argparse.Namespace) -> TrainConfig:
    values, per_device = {}, getattr(args, "batch_per_device", False)
    if args.config:
        import tomllib
        try:
            from .files import open_regular
            with open_regular(args.config, what="TOML config") as f:
                raw = tomllib.loads(f.read())
            values = {_field(k): v for k, v in raw.items()}
            per_device = per_device or (args.batch is None and any(
                "--" + k.replace("_", "-") == ALIASES["batch"] for k in raw))
        except FileNotFoundError:
            raise LoracError(f"config file not found: {args.config}") from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise LoracError(f"{args.config}: not valid TOML ({e})") from None
        known = {f.name for f in fields(TrainConfig)} - {"extra"}
        unknown = sorted(set(values) - known)
        if unknown:
            raise LoracError(f"{args.config}: unknown setting(s) {', '.join(unknown)}")
        _check_types(values, args.config)
    for f in fields(TrainConfig):
        v = getattr(args, f.name, None)
        if v is not None:
            values[f.name] = v
    if isinstance(values.get("lora_targets"), str):
        values["lora_targets"] = tuple(t.strip() for t in values["lora_targets"].split(",") if t.strip())
    elif isinstance(values.get("lora_targets"), list):
        values["lora_targets"] = tuple(values["lora_targets"])
    if per_device and isinstance(values.get("batch"), int):  # TRL's meaning: rows per worker
        from .dist import requested_workers
        values["batch"] *= requested_workers(values.get("gpus", 0))
    return TrainConfig(**values)


def _check_types(values: dict, where: str) -> None:
    """Each TOML value of the type its flag takes (targets: a string or a list of strings)."""
    defaults = TrainConfig()
    for key, v in values.items():
        d = getattr(defaults, key)
        typed = next(f.metadata.get("type") for f in fields(TrainConfig) if f.name == key)
        if key == "checkpointing":  # on/off/auto, or true/false as when it was a switch
            ok, kind = isinstance(v, (str, bool)), "auto, on, off, offload, true or false"
        elif typed is float:
            ok, kind = isinstance(v, (int, float)) and not isinstance(v, bool), "a number"
        elif key == "lora_targets":
            ok, kind = isinstance(v, str) or (isinstance(v, list) and all(isinstance(t, str) for t in v)), \
                "a string or a list of strings"
        elif isinstance(d, bool):
            ok, kind = isinstance(v, bool), "true or false"
        elif isinstance(d, (int, float)):
            want = int if isinstance(d, int) else (int, float)
            ok, kind = isinstance(v, want) and not isinstance(v, bool), "an integer" if want is int else "a number"
        else:
            ok, kind = isinstance(v, str), "a string"
        if not ok:
            raise LoracError(f"{where}: {key} = {v!r} must be {kind}")


def cmd_train(args) -> int:
    import signal

    from . import dist as distributed
    from .train.loop import train
    cfg = train_config(args)
    if cfg.gpus > 1 and not distributed.under_mpi() and not cfg.compile_only:
        from .dist.launch import launch  # --gpus N: start N workers through mpiexec, each runs this command
        return launch(cfg, args.argv)
    summary = train(cfg)
    if distributed.current().main:  # data parallel: rank 0 speaks for the run
        print(json.dumps(summary, indent=1))
    if summary.get("interrupted"):  # a checkpoint was saved; the exit status says the run is not done
        return 128 + int(getattr(signal, summary.get("stopped_by") or "SIGINT"))
    return 0


def cmd_compile(argv) -> int:
    from lorac.compiler.cli import compile_command
    return compile_command(argv, note=lambda target: devices.for_target(target).unavailable(target))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="lorac", description="Graph-compiled LoRA training: compile once, train anywhere.")
    sub = ap.add_subparsers(dest="command", metavar="{compile,train,eval,generate,export}")
    sub.add_parser("compile", help="compile an ONNX graph into an artifact (lorac compile --help)", add_help=False)
    p = sub.add_parser("train", help="fine-tune a LoRA adapter (no arguments: the bundled demo)",
                       description="Fine-tune a LoRA adapter with LoRA+ AdamW. With no arguments: SmolLM2-135M-"
                                   "Instruct on the bundled Jargon File corpus, on this CPU, into ./lorac-out.")
    # --quantized-base's short spelling, declared first so the field's own flag is its dest's action
    p.add_argument("--dequantize", dest="quantized_base", action="store_const", const="dequantize",
                   help="hold a quantized base dense, dequantized on load: --quantized-base dequantize")
    _add_train_flags(p)
    p.set_defaults(func=cmd_train)
    for name, helptext in (("eval", "loss of base model or checkpoint on a data file"),
                           ("generate", "sample text from base model + adapter")):
        q = sub.add_parser(name, help=helptext, description=helptext)
        q.add_argument("--checkpoint", help="checkpoint directory (or OUT/checkpoints); omit for the base model")
        q.add_argument("--model", help="model (default: the one the checkpoint was trained on)")
        q.add_argument("--target", default=DEFAULTS.target,
                       help=f"{', '.join(devices.targets())} (default: {DEFAULTS.target})")
        q.add_argument("--backend", default="tvm", choices=("tvm", "ort"), help=help_of(TrainConfig, "backend"))
        q.add_argument("--ort-providers", help=help_of(TrainConfig, "ort_providers"))
        q.add_argument("--cache-dir", default=DEFAULTS.cache_dir,
                       help=f"{help_of(TrainConfig, 'cache_dir')} (default: {DEFAULTS.cache_dir})")
        q.add_argument("--batch", type=int, default=None, help="batch (default: the checkpoint's)")
        q.add_argument("--seq", type=int, default=None, help="sequence length (default: the checkpoint's)")
        if name == "eval":
            q.add_argument("--data", required=True, help="data file to score (every document counts)")
            q.add_argument("--packing", choices=("auto", "plain", "isolated"), default=None,
                           help="how documents share a row (default: the checkpoint's, else auto; see lorac train --help)")
            q.add_argument("--truncate", choices=("none", "prompt-left"), default=None,
                           help="prompt-left: cut long prompts from the left, each example in one row (default: the "
                                "checkpoint's, else none; see lorac train --help)")
            q.set_defaults(func=cmd_eval)
        else:
            q.add_argument("--prompt", required=True, help="prompt text (wrapped in the chat template if any)")
            q.add_argument("--raw", action="store_true", help="do not apply the chat template")
            q.add_argument("--max-new-tokens", type=int, default=64)
            q.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
            q.add_argument("--top-p", type=float, default=1.0)
            q.add_argument("--repetition-penalty", type=float, default=None,
                           help="transformers' repetition penalty (1: none; default: the model's "
                                "generation_config.json, else 1)")
            q.add_argument("--seed", type=int, default=0)
            q.add_argument("--window", type=int, default=128, help="static context window of the forward graph")
            q.set_defaults(func=cmd_generate, batch=1)
    q = sub.add_parser("export", help="export a checkpoint's adapter, or a model's ONNX graph",
                       description="Export a checkpoint's adapter: PEFT directory, merged HF model, GGUF LoRA "
                                   "adapter for llama.cpp, or a merged GGUF; or the ONNX graph of a model.")
    q.add_argument("--checkpoint", help="checkpoint directory (or OUT/checkpoints); onnx: optional")
    q.add_argument("--format", choices=FORMATS, default="peft",
                   help="peft (directory), merged (HF directory), gguf (llama.cpp LoRA file), gguf-merged (the GGUF "
                        "base with the LoRA folded in) or onnx (the model's graph, no checkpoint needed); default: peft")
    q.add_argument("--out", required=True, help="output directory (peft, merged) or file (gguf, gguf-merged, onnx); "
                   "never the base model or the checkpoint; an existing directory is replaced only when it holds a "
                   "previous export")
    q.add_argument("--model", help="base model (default: the checkpoint's)")
    q.add_argument("--dtype", choices=("bfloat16", "float16", "float32", "q8_0", "base"),
                   help="merged: the weights' dtype (default: the base's; bfloat16 for a quantized GGUF base); "
                        "gguf-merged: the adapted matrices' type (default: float16; q8_0 quantizes them; base: each "
                        "in its base tensor's own type, e.g. Q4_K, as llama.cpp quantizes it)")
    g = q.add_argument_group("onnx", "the graph and its shapes (default: the checkpoint's settings, else these)")
    g.add_argument("--graph", choices=GRAPHS, default="train", help="train (loss and LoRA gradients), eval (loss) or "
                   "forward (logits); default: train")
    g.add_argument("--batch", type=int, help="sequences per batch (default: 1)")
    g.add_argument("--seq", type=int, help=f"tokens per sequence (default: {DEFAULTS.seq})")
    g.add_argument("--rank", type=int, help=f"LoRA rank (default: {DEFAULTS.rank})")
    g.add_argument("--alpha", type=float, help=f"LoRA alpha (default: {DEFAULTS.alpha:g})")
    g.add_argument("--targets", help="comma-separated LoRA targets (default: every linear layer)")
    g.add_argument("--packing", choices=("plain", "isolated"), help="isolated: the graph also takes position_ids "
                   "[batch, seq] and keeps attention inside each document (default: the checkpoint's, else plain)")
    q.set_defaults(func=cmd_export)
    return ap


def _dashes(arg: str) -> str:
    """--learning_rate=x -> --learning-rate=x (the flag's name only, never a value)."""
    if not arg.startswith("--"):
        return arg
    name, eq, value = arg.partition("=")
    return name.replace("_", "-") + eq + value


_NEGATIVE = re.compile(r"^-(\d|\.\d|inf$|nan$)", re.IGNORECASE)  # -1e-3, -5, -.5, -inf


def _negative_values(argv: list[str]) -> list[str]:
    """`--lr -1e-3` -> `--lr=-1e-3`: argparse takes a dash-led word for a flag (unless it looks like
    a plain -5 or -0.5), so a negative value in exponent form was "expected one argument"; joined,
    every value reaches the setting's own check, which names the flag."""
    out = []
    for a in argv:
        if out and _NEGATIVE.match(a) and out[-1].startswith("--") and "=" not in out[-1]:
            out[-1] += "=" + a
        else:
            out.append(a)
    return out


def main(argv=None) -> int:
    argv = _negative_values([_dashes(a) for a in (sys.argv[1:] if argv is None else argv)])
    if argv and argv[0] == "compile":
        return _guard(lambda: cmd_compile(argv[1:]))
    ap = build_parser()
    args = ap.parse_args(argv)
    args.argv = argv
    if not getattr(args, "func", None):
        if not argv:  # `lorac` alone: the demo is `lorac train`
            ap.print_help()
            return 0
        ap.error("choose a command")
    return _guard(lambda: args.func(args))


class Terminated(BaseException):
    """SIGTERM or SIGHUP outside the training loop (which saves a checkpoint on them itself)."""


def _terminate(signum, _frame):
    raise Terminated(signum)


def _guard(fn) -> int:
    """Run a command: every failure ends as one line on stderr and a nonzero status."""
    import signal
    # SIGTERM/SIGHUP unwind (temp files go, locks are released) instead of dying mid-write
    previous = {sig: signal.signal(sig, _terminate) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        return _run(fn)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _run(fn) -> int:
    import signal
    try:
        return fn()
    except LoracError as e:
        print(f"lorac: error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:  # spec validation (lorac.graphs) raises plain ValueErrors with one line
        print(f"lorac: error: {_first_line(e)}", file=sys.stderr)
        return 2
    except OSError as e:  # disk full, permission denied, a path that is a folder, ...
        where = f"{e.filename}: " if e.filename else ""
        print(f"lorac: error: {where}{e.strerror or _first_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("lorac: interrupted", file=sys.stderr)
        return 130
    except Terminated as e:
        print(f"lorac: terminated by {signal.Signals(e.args[0]).name}", file=sys.stderr)
        return 128 + e.args[0]
    except Exception as e:  # a bug: still one line, the traceback on request
        if os.environ.get("LORAC_TRACEBACK"):
            raise
        print(f"lorac: internal error: {type(e).__name__}: {_first_line(e)} (a bug in lorac; set LORAC_TRACEBACK=1 "
              "to see where)", file=sys.stderr)
        return 1


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def console() -> None:
    """The `lorac` command. lorac itself never imports torch, but TVM's FFI imports it
    eagerly whenever it is installed (~2 s added to every command in an environment that
    has it, e.g. one with the test extra); the command's own process keeps it out."""
    sys.modules.setdefault("torch", None)
    from .dist import exit_code
    sys.exit(exit_code(main()))  # a failed data-parallel worker ends the whole job


if __name__ == "__main__":
    console()
