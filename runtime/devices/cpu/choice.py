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
its own choices beside the others).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from lorac.core import atomic

ROUNDS, QUICK_ROUNDS, QUICK_S = 3, 7, 0.02
FILE = "cpu-gemm.json"
SPLITS = ("whole", "rows", "cols")
_libraries = ""
_choices: dict[str, tuple[str, str]] = {}
_file: Path | None = None
_timed: set[str] = set()  # the keys whose choice was timed (or read): the ones the file keeps


def configure(libraries: str) -> None:
    global _libraries
    _libraries = libraries
    _choices.clear()
    _timed.clear()


def set_file(folder) -> None:
    """Read and from now on write the choices of `folder`/cpu-gemm.json."""
    global _file
    path = Path(folder) / FILE
    if path == _file:
        return
    _file = path
    for key, plan in _read(path).get(_libraries, {}).items():
        parts = str(plan).split("/")
        if len(parts) == 2 and f"{parts[0]}=" in _libraries and parts[1] in SPLITS:  # else: not ours, timed anew
            _choices.setdefault(key, (parts[0], parts[1]))
            _timed.add(key)


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in data.items() if isinstance(v, dict)} if isinstance(data, dict) else {}


def get(key: str):
    return _choices.get(key)


def remember(key: str, plan: tuple[str, str]) -> tuple[str, str]:
    """The only candidate of `key` (kept in memory, not timed, not written)."""
    _choices[key] = plan
    return plan


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
    plan = min(best, key=best.get)
    _choices[key] = plan
    _timed.add(key)
    _save()
    return plan


def _save() -> None:
    if _file is None:
        return
    data = _read(_file)
    data[_libraries] = {k: "/".join(v) for k, v in sorted(_choices.items()) if k in _timed}
    try:
        _file.parent.mkdir(parents=True, exist_ok=True)
        atomic.write_text(_file, json.dumps(data, indent=1) + "\n")
    except OSError:
        pass  # a read-only cache: the choices stay in this process


def choices() -> dict[str, str]:
    return {k: "/".join(v) for k, v in _choices.items()}
