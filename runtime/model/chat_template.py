"""Chat templates rendered as transformers renders them, in a sandbox with bounds.

A chat template comes with the model, from whoever published it: jinja2's immutable sandbox
stops it from reaching Python internals (SSTI), and lorac bounds what it may cost:

- size: no value the template builds, and not its output, may exceed `limit` characters
  (1 Mi plus 8 times the conversation's text). Repetition (`'x' * n`), powers, `+`, `~`,
  `%`-formatting, `.format` and the filters and methods that widen a string (center, ljust,
  indent, replace, join, ...) are checked before they allocate; everything else after;
  `join` over a generator (`range(4000)|map('string')|join(sep)`) is gathered item by item and
  stopped once its result would pass the limit, before it is built;
- time: a render stops after TIME_LIMIT seconds (a timer signal; on the main thread, where
  lorac renders), so nested loops cannot hang a run; and all renders of one template (a run's
  data preparation renders every conversation 1 + 2 x its answers times) may take at most
  TOTAL_BASE seconds plus TOTAL_PER_RENDER per render: a template that takes a second a time
  would otherwise stall a run of 400 chats for minutes. Past that the run stops, naming the
  template's origin.

Any failure inside a template (a SecurityError, an undefined name, a TypeError, a bound hit)
becomes one LoracError line naming the template.
"""
from __future__ import annotations

import json
import re
import signal
import threading
import time
from contextlib import contextmanager

from ..errors import LoracError

BASE_LIMIT = 1 << 20  # characters any conversation's template may build
TIME_LIMIT = 5.0      # seconds per render
TOTAL_BASE = 30.0     # seconds all renders of one template may take, plus
TOTAL_PER_RENDER = 0.02  # seconds per render (chat templates of real models take well under 1 ms)
MAX_POWER_BITS = 1 << 16  # an integer power may have at most this many bits
_WIDE_FORMAT = re.compile(r"\d{7,}|\*")  # a width of 10^6 or more, or one taken from the arguments


class _Stop(BaseException):
    """A bound was hit (BaseException: nothing inside jinja2 may swallow it)."""
    TIMER = "timer"  # the argument of the one the render's timer raises


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

        def bounded_items(self, items, sep):
            """An iterable to join, as a list gathered one item at a time: stopped once the
            joined string would pass the limit (the join itself would allocate it all at once)."""
            if isinstance(items, (str, list, tuple, dict, set)) or items is None:
                return items
            out, n = [], 0
            for x in items:
                n += len(x if isinstance(x, str) else str(x)) + len(str(sep))
                if n > self.limit:
                    raise _Stop(f"its join would build more than the {self.limit} characters allowed")
                out.append(x)
            return out

        def call(self, __context, __obj, *args, **kwargs):
            owner = getattr(getattr(__obj, "__wrapped__", __obj), "__self__", None)
            if getattr(__obj, "__name__", "") == "join" and isinstance(owner, str) and args:
                args = (self.bounded_items(args[0], owner),) + args[1:]
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
                items = items if isinstance(items, (list, tuple)) else []  # iterators: gathered by bounded_items
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
        if fn.__name__ == "do_join" and len(args) > head:  # gathered within the bound first
            sep = args[head + 1] if len(args) > head + 1 else kwargs.get("d", "")
            args = args[:head] + (env.bounded_items(args[head], sep),) + args[head + 1:]
        subject, rest = (args[head], args[head + 1:]) if len(args) > head else (None, ())
        env.check_call(fn.__name__.removeprefix("do_"), subject, rest, kwargs)
        return env.sized(fn(*args, **kwargs))

    if passes is not None:
        filtered.jinja_pass_arg = passes
    filtered.__name__ = fn.__name__
    return filtered


def compile_template(source: str, origin: str = ""):
    """Compile a chat template the way transformers does: sandboxed jinja2, trim_blocks,
    lstrip_blocks, a `raise_exception` helper and a `tojson` that keeps non-ASCII. `origin`: where
    the template comes from (the model), named when it is too slow."""
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
    env.origin, env.spent, env.renders = origin, 0.0, 0  # the total time bound (module doc)
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
    budget = max(TOTAL_BASE + TOTAL_PER_RENDER * (env.renders + 1) - env.spent, 1e-3)  # what the total leaves
    t0 = time.perf_counter()
    try:
        with _deadline(min(TIME_LIMIT, budget)):
            for piece in template.generate(**context):
                n += len(piece)
                if n > env.limit:
                    raise _Stop(f"its output passes the {env.limit} characters allowed")
                out.append(piece)
    except LoracError:
        raise
    except _Stop as e:
        if e.args and e.args[0] == _Stop.TIMER and budget < TIME_LIMIT:  # the total, not this render, ran out
            _count(env, t0)
            raise LoracError(_too_slow(env)) from None
        why = f"it ran past its time limit of {TIME_LIMIT:g} s" if e.args and e.args[0] == _Stop.TIMER else \
            e.args[0] if e.args else "over its time limit"
        raise LoracError(f"chat template stopped: {why}") from None
    except (RecursionError, MemoryError) as e:
        raise LoracError(f"chat template stopped: {type(e).__name__}") from None
    except Exception as e:  # SecurityError, UndefinedError, TypeError, ... raised by the template's code
        raise LoracError(f"chat template failed: {type(e).__name__}: {_line(e)}") from None
    finally:
        _count(env, t0)
    if env.spent > TOTAL_BASE + TOTAL_PER_RENDER * env.renders:
        raise LoracError(_too_slow(env))
    return "".join(out)


def _count(env, t0: float) -> None:
    """Add one render's time to the template's total (once, however the render ended)."""
    if getattr(env, "_counted", None) != t0:
        env._counted = t0
        env.spent += time.perf_counter() - t0
        env.renders += 1


def _too_slow(env) -> str:
    return (f"the chat template{' of ' + str(env.origin) if env.origin else ''} is too slow: {env.renders} renders took "
            f"{env.spent:.1f} s ({env.spent / env.renders * 1e3:.0f} ms each; a model's template takes well under 1 ms), "
            f"past the {TOTAL_BASE:g} s + {TOTAL_PER_RENDER * 1e3:g} ms per render allowed; fix or replace the template")


def _line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


@contextmanager
def _deadline(seconds: float):
    """Raise _Stop in the main thread after `seconds` (a no-op elsewhere: signals go there)."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def expired(_signum, _frame):
        raise _Stop(_Stop.TIMER)

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
