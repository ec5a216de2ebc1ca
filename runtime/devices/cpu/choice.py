"""The fastest (library, split) of each CPU GEMM shape, timed once on this machine and kept.

`pick` runs every candidate on the call's own operands in interleaved rounds and keeps the
one that took the least CPU time (the process's, all its threads) in its best round: 3
rounds, 7 where a round takes under 20 ms; candidates more than 1.5x slower than the best
after the first round are dropped. CPU time, not wall time: on a shared host other processes
stretch the wall time of whatever runs while they do (by 2-5x at a load of 5 on 2 cores
here), while the work a library does for a GEMM stays about the same. The candidates are
alike in their parallelism (blas.py offers either splits over all threads or one whole call,
by size), so CPU time ranks them as wall time would on a quiet host. The choices live in memory
and, once an artifact cache is known (`set_file`), in its .lorac-tuning/cpu-gemm.json:
{"<library names and versions; threads>": {shape key: "library/split"}}, one section per set
of libraries and thread count (a run restricted to one library, or with other threads, keeps
its own choices beside the others; the file is runtime/devices/_choices.py's).
"""
from __future__ import annotations

import time

from .._choices import Choices

ROUNDS, QUICK_ROUNDS, QUICK_S = 3, 7, 0.02
FILE = "cpu-gemm.json"
SPLITS = ("whole", "rows", "cols")


def _decode(text: str):
    parts = text.split("/")
    if len(parts) == 2 and f"{parts[0]}=" in _store.section and parts[1] in SPLITS:
        return parts[0], parts[1]
    return None  # not ours: timed anew


_store = Choices(FILE, encode="/".join, decode=_decode)
get, remember = _store.get, _store.remember


def configure(libraries: str) -> None:
    _store.configure(libraries)


def set_file(folder) -> None:
    """Read and from now on write the choices of `folder`/cpu-gemm.json."""
    _store.set_file(folder)


def libraries() -> str:
    """The section of the file this process's choices live in: libraries, versions, threads."""
    return _store.section


def pick(key: str, candidates: list, run, keep=None) -> tuple[str, str]:
    """The fastest of `candidates` for `key`, `run(candidate)` doing one call; `keep`, an array
    the runs overwrite that the real call must still find (an accumulating output), is restored."""
    saved = keep.copy() if keep is not None else None
    best: dict = {}
    rounds = ROUNDS
    for r in range(QUICK_ROUNDS):
        if r == rounds:
            break
        if r == 1 and sum(best.values()) < QUICK_S:
            rounds = QUICK_ROUNDS
        if r:
            fastest = min(best.values())
            candidates = [c for c in candidates if best[c] <= 1.5 * fastest]
            if len(candidates) == 1:
                break
        for c in candidates:
            t = time.process_time()
            run(c)
            best[c] = min(best.get(c, float("inf")), time.process_time() - t)
    if saved is not None:
        keep[...] = saved
    return _store.keep(key, min(best, key=best.get))


def choices() -> dict[str, str]:
    return {k: "/".join(v) for k, v in _store.values.items()}
