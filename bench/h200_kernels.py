"""Every GPU kernel of lorac's full training step, timed by CUPTI (through torch.profiler).

    python3 bench/h200_kernels.py CACHE CASE [TOP]     (GPU machine; cases of h200_vs_peers.py)

The step is the one `lorac train` runs (compiled step in CUDA graphs, loss read, LoRA+ AdamW
update). torch is imported only for its profiler: CUPTI records every kernel the process
launches, those replayed from lorac's CUDA graphs included, with its GPU start and end. Prints
one JSON line: the step's wall time, the GPU's busy time (union of kernel intervals), time per
kernel group (cuBLAS GEMMs, cuDNN attention, TVM kernels, copies), and the TOP kernels by time
with calls and mean microseconds.
"""
from __future__ import annotations

import json
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch  # noqa: F401  (the profiler only; lorac itself does not use torch)
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent))
from h200_vs_peers import case_engine, full_step, pin_source  # noqa: E402

GROUPS = [("cudnn", re.compile(r"cudnn|sdpa|fmha|flash", re.I)),
          ("gemm", re.compile(r"gemm|nvjet|xmma|cutlass|cublas|splitK|reduce_kernel", re.I)),
          ("memcpy/memset", re.compile(r"^Memcpy|^Memset|memcpy|memset", re.I))]


def group_of(name: str) -> str:
    for g, pat in GROUPS:
        if pat.search(name):
            return g
    return "tvm"


def busy_ms(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total / 1e3


def gaps(events: list[tuple[float, float, str]], n: int, least_us: float = 50.0, top: int = 15) -> list[dict]:
    """Where the GPU's compute waits: each gap of at least `least_us` between one compute kernel's
    end and the next one's start (copies left out, so a compute kernel waiting on a copy shows),
    summed by the kernels either side, largest first."""
    compute = sorted((s, e, name) for s, e, name in events if group_of(name) != "memcpy/memset")
    by: dict[tuple[str, str], list[float]] = defaultdict(list)
    end, before = float("-inf"), ""
    for s, e, name in compute:
        if s - end >= least_us and before:
            by[(before[:70], name[:70])].append(s - end)
        if e > end:
            end, before = e, name
    rows = sorted(by.items(), key=lambda kv: -sum(kv[1]))[:top]
    return [{"ms": round(sum(g) / 1e3 / n, 3), "count": len(g) // n or len(g), "mean_us": round(sum(g) / len(g), 1),
             "after": a, "before": b} for (a, b), g in rows]


def main(cache: str, case: str, top: int = 40) -> None:
    pin_source(cache)  # the cache's artifacts, whatever this checkout's source hash
    eng, _, optim, _, batches, _ = case_engine(cache, case)
    for t in range(1, 5):
        full_step(eng, optim, batches[t % len(batches)], t)
    n = 3
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for t in range(5, 5 + n):
            full_step(eng, optim, batches[t % len(batches)], t)
    wall_ms = (time.perf_counter() - t0) * 1e3 / n
    per: dict[str, list[float]] = defaultdict(list)
    intervals, events = [], []
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        start, dur = ev.time_range.start, ev.time_range.end - ev.time_range.start
        per[ev.name].append(dur)
        intervals.append((start, start + dur))
        events.append((start, start + dur, ev.name))
    groups: dict[str, dict] = defaultdict(lambda: {"ms": 0.0, "calls": 0})
    for name, ds in per.items():
        g = groups[group_of(name)]
        g["ms"] += sum(ds) / 1e3 / n
        g["calls"] += len(ds) // n
    rows = sorted(per.items(), key=lambda kv: -sum(kv[1]))[:top]
    print(json.dumps({
        "case": case, "wall_ms": round(wall_ms, 2), "gpu_busy_ms": round(busy_ms(intervals) / n, 2),
        "groups": {k: {"ms": round(v["ms"], 2), "calls": v["calls"]} for k, v in groups.items()},
    }), flush=True)
    compute = [(s, e) for s, e, name in events if group_of(name) != "memcpy/memset"]
    print(json.dumps({"compute_busy_ms": round(busy_ms(compute) / n, 2), "span_ms": round(
        (max(e for _, e in compute) - min(s for s, _ in compute)) / 1e3 / n, 2)}))
    for row in gaps(events, n):
        print(json.dumps({"gap": row}))
    for name, ds in rows:
        print(json.dumps({"ms": round(sum(ds) / 1e3 / n, 3), "calls": len(ds) // n,
                          "mean_us": round(sum(ds) / len(ds), 1), "group": group_of(name), "kernel": name[:160]}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 40)
