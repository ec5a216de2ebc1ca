"""What of cuDNN's Python frontend is still alive when a CUDA run exits (there: the GPU machine).

nanobind prints `nanobind: leaked ...` at interpreter exit when instances of its types outlive
Python's teardown (and then every type and function of the module too). lorac frees its plans
and handle at exit (runtime/devices/cuda/attention.py release()); if the report still comes,
this names what holds the rest.

    python bench/cudnn_exit_leaks.py -- train --target cuda --model M --data D --steps 2 ...

runs `lorac ARGS` in this process, then, at exit after lorac's own release, prints one JSON
line: the live objects of the cudnn package by type (those the garbage collector tracks: the
Python wrappers that hold the nanobind instances) and, for the first few, the types of what
refers to them. `"alive": {}` means lorac left nothing behind.
"""
from __future__ import annotations

import atexit
import gc
import json
import sys
from collections import Counter


def _report() -> None:
    gc.collect()
    live = [o for o in gc.get_objects() if type(o).__module__.split(".")[0] == "cudnn"]
    referrers = {}
    for o in live[:5]:
        refs = [r for r in gc.get_referrers(o) if r is not live]
        referrers[type(o).__qualname__] = sorted({type(r).__qualname__ for r in refs})
    print(json.dumps({"alive": dict(Counter(type(o).__qualname__ for o in live)), "referrers": referrers}),
          flush=True)


def main(argv: list[str]) -> int:
    import cudnn  # noqa: F401 - its exit hooks first, so _report (registered next) runs after lorac's
    atexit.register(_report)  # atexit runs last-registered first: lorac's release() comes before this
    from lorac.runtime.cli import main as lorac
    return lorac(argv[1:] if argv[:1] == ["--"] else argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
