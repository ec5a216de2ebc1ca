"""Chat templates rendered as transformers renders them, in a sandbox with bounds.

A chat template comes with the model, from whoever published it: jinja2's immutable sandbox
stops it from reaching Python internals (SSTI), and lorac bounds what it may cost:

- size: no value the template builds, and not its output, may exceed `limit` characters
  (1 Mi plus 8 times the conversation's text). Repetition (`'x' * n`), powers, `+`, `~`,
  `%`-formatting, `.format` and the filters and methods that widen a string (center, ljust,
  indent, replace, join, ...) are checked before they allocate; everything else after;
- time: a render stops after TIME_LIMIT seconds (a timer signal; on the main thread, where
  lorac renders), so nested loops cannot hang a run.

Any failure inside a template (a SecurityError, an undefined name, a TypeError, a bound hit)
becomes one LoracError line naming the template.
"""
from __future__ import annotations

import json
import re
import signal
import threading
from contextlib import contextmanager

from ..errors import LoracError

BASE_LIMIT = 1 << 20  # characters any conversation's template may build
TIME_LIMIT = 5.0      # seconds per render
MAX_POWER_BITS = 1 << 16  # an integer power may have at most this many bits
_WIDE_FORMAT = re.compile(r"\d{7,}|\*")  # a width of 10^6 or more, or one taken from the arguments


class _Stop(BaseException):
    """A bound was hit (BaseException: nothing inside jinja2 may swallow it)."""


def _sandbox_class():
    from jinja2.compiler import CodeGenerator
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedCodeGenerator(CodeGenerator):
        def visit_Concat(self, node, frame):  # `a ~ b`: the joined string is size-checked
            self.write("environment.sized(")
            super().visit_Concat(node, frame)
            self.write(")")

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "+", "%"})
        code_generator_class = BoundedCodeGenerator
        limit = BASE_LIMIT

        def sized(self, value):
            n = len(value) if isinstance(value, (str, bytes, list, tuple, dict, set)) else 0
            if n > self.limit:
                raise _Stop(f"it builds a value of {n} items, more than the {self.limit} allowed")
            return value

        def call_binop(self, context, operator, left, right):
            if operator == "*":
                seq, n = (left, right) if isinstance(right, int) else (right, left)
                if isinstance(n, int) and hasattr(seq, "__len__") and len(seq) * max(n, 0) > self.limit:
                    raise _Stop(f"it repeats a value {n} times, past the {self.limit} items allowed")
            elif operator == "**" and isinstance(left, (int, float)) and isinstance(right, (int, float)):
                if abs(left) > 1 and right * max(abs(int(left)), 2).bit_length() > MAX_POWER_BITS:
                    raise _Stop(f"it raises {left} to the power {right}")
            elif operator == "%" and isinstance(left, str):
                self.check_call("format", left, (), {})
            return self.sized(super().call_binop(context, operator, left, right))

        def call(self, __context, __obj, *args, **kwargs):
            owner = getattr(getattr(__obj, "__wrapped__", __obj), "__self__", None)
            self.check_call(getattr(__obj, "__name__", ""), owner, args, kwargs)
            return self.sized(super().call(__context, __obj, *args, **kwargs))

        def check_call(self, name: str, subject, args, kwargs) -> None:
            """Refuse, before it runs, a call (method `name` of `subject`, or filter `name` on
            it) with a huge count, a wide format, or a join/replace/indent result past the limit."""
            for v in list(args) + list(kwargs.values()):
                if isinstance(v, int) and not isinstance(v, bool) and abs(v) > self.limit:
                    raise _Stop(f"it passes {v} to {name or 'a function'}, past the {self.limit} allowed")
            if not isinstance(subject, str) and name != "join":
                return
            if name in ("format", "format_map") and _WIDE_FORMAT.search(subject):
                raise _Stop("it formats with a width of a million or more (or one taken from its arguments)")
            estimate = 0
            if name == "join":  # str.join(items) (subject: the separator) or items|join(sep)
                items, sep = (args[0], subject) if isinstance(subject, str) else (subject, args[0] if args else "")
                items = items if isinstance(items, (list, tuple)) else []  # never consume an iterator
                estimate = sum(len(x) for x in items if isinstance(x, str)) + len(str(sep)) * len(items)
            elif name == "replace" and len(args) >= 2 and all(isinstance(a, str) for a in args[:2]):
                estimate = len(subject) + (subject.count(args[0]) if args[0] else len(subject) + 1) * len(args[1])
            elif name == "indent":
                width = args[0] if args else kwargs.get("width", 4)
                estimate = len(subject) + (subject.count("\n") + 1) * (len(width) if isinstance(width, str) else width)
            if estimate > self.limit:
                raise _Stop(f"its {name} would build {estimate} characters, past the {self.limit} allowed")

    return BoundedSandbox


def _bounded_filter(env, fn):
    """A filter checked like a call: its arguments before it runs, its result after."""
    passes = getattr(fn, "jinja_pass_arg", None)  # jinja2 hands context/environment first to these

    def filtered(*args, **kwargs):
        head = 1 if passes is not None else 0
        subject, rest = (args[head], args[head + 1:]) if len(args) > head else (None, ())
        env.check_call(fn.__name__.removeprefix("do_"), subject, rest, kwargs)
        return env.sized(fn(*args, **kwargs))

    if passes is not None:
        filtered.jinja_pass_arg = passes
    filtered.__name__ = fn.__name__
    return filtered


def compile_template(source: str):
    """Compile a chat template the way transformers does: sandboxed jinja2, trim_blocks,
    lstrip_blocks, a `raise_exception` helper and a `tojson` that keeps non-ASCII."""
    try:
        from jinja2 import TemplateError
    except ImportError:
        raise LoracError("chat templates need the jinja2 package (pip install jinja2)") from None

    def raise_exception(message):
        raise LoracError(f"chat template: {message}")

    def tojson(x, indent=None):
        return json.dumps(x, ensure_ascii=False, indent=indent)

    env = _sandbox_class()(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.filters = {name: _bounded_filter(env, fn) for name, fn in env.filters.items()}
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(source)  # jinja2 folds constant filter calls here: bounds apply
    except (TemplateError, _Stop) as e:
        raise LoracError(f"chat template does not compile: {_line(e)}") from None


def render(template, text_size: int, **context) -> str:
    """Render `template` within the bounds of the module doc; `text_size`: the characters of
    the conversation's own text (the size bound grows with it)."""
    env = template.environment
    env.limit = BASE_LIMIT + 8 * text_size
    out, n = [], 0
    try:
        with _deadline(TIME_LIMIT):
            for piece in template.generate(**context):
                n += len(piece)
                if n > env.limit:
                    raise _Stop(f"its output passes the {env.limit} characters allowed")
                out.append(piece)
    except LoracError:
        raise
    except _Stop as e:
        raise LoracError(f"chat template stopped: {e.args[0] if e.args else 'over its time limit'}") from None
    except (RecursionError, MemoryError) as e:
        raise LoracError(f"chat template stopped: {type(e).__name__}") from None
    except Exception as e:  # SecurityError, UndefinedError, TypeError, ... raised by the template's code
        raise LoracError(f"chat template failed: {type(e).__name__}: {_line(e)}") from None
    return "".join(out)


def _line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


@contextmanager
def _deadline(seconds: float):
    """Raise _Stop in the main thread after `seconds` (a no-op elsewhere: signals go there)."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def expired(_signum, _frame):
        raise _Stop(f"it ran past its time limit of {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
