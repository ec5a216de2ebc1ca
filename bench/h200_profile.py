"""Where a compiled step's time goes on the GPU: GEMMs, TVM kernels, and the host.

    python3 bench/h200_profile.py ART_DIR [ART_DIR ...]   (runtime-only TVM; no torch)

TVM 0.27's runtime has no profiler, so this uses the VM's instrument hook: around every
call the VM makes (a cuBLAS GEMM through lorac.gemm_*, a TVM kernel, a VM builtin) it
synchronizes the device and reads the clock. Each call's time then includes one launch and
one synchronization (`sync_us`, measured on an empty stream, is printed for scale). Besides
the grouped times it prints the plain step time (no hook) and how long the host takes to
enqueue one step, which is the floor of a step that the GPU cannot hide.
"""
from __future__ import annotations

import json
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.modules["torch"] = None  # the runtime must not need torch
sys.path.insert(0, str(Path(__file__).parent))
from h200_check import device_inputs, time_step  # noqa: E402

from lorac.runtime.artifact import load_artifact  # noqa: E402


def _group(symbol: str) -> str:
    if symbol.startswith("lorac.gemm"):
        return "gemm"
    if symbol.startswith("vm.builtin.") or symbol.startswith("relax."):
        return "vm_builtin"
    return "tvm_kernel"


def profile(art: str, steps: int = 5) -> dict:
    device = json.loads((Path(art) / "manifest.json").read_text())["target"]["device"]
    step = load_artifact(art, device)
    _, args = device_inputs(step)
    dev = step._dev
    step_ms = time_step(step, args, n=steps, warm=2) * 1e3
    t = time.perf_counter()
    step(args, as_numpy=False)
    enqueue_ms = (time.perf_counter() - t) * 1e3
    dev.sync()
    t = time.perf_counter()
    for _ in range(100):
        dev.sync()
    sync_us = (time.perf_counter() - t) / 100 * 1e6

    per_symbol: dict[str, list[float]] = defaultdict(list)
    clock = {}

    def hook(func, symbol, before, ret, *a):
        dev.sync()
        now = time.perf_counter()
        if before:
            clock["t"] = now
        else:
            per_symbol[symbol].append(now - clock["t"])
        return 0  # VMInstrumentReturnKind.kNoOp: run the call as usual

    step._vm.set_instrument(hook)
    step(args, as_numpy=False)  # warm the hook path
    per_symbol.clear()
    t = time.perf_counter()
    step(args, as_numpy=False)
    dev.sync()
    hooked_ms = (time.perf_counter() - t) * 1e3

    groups: dict[str, dict] = defaultdict(lambda: {"ms": 0.0, "calls": 0})
    for sym, ts in per_symbol.items():
        g = groups[_group(sym)]
        g["ms"] += sum(ts) * 1e3
        g["calls"] += len(ts)
    top = sorted(per_symbol.items(), key=lambda kv: -sum(kv[1]))[:12]
    return {
        "artifact": Path(art).name, "step_ms": round(step_ms, 2), "enqueue_ms": round(enqueue_ms, 2),
        "sync_us": round(sync_us, 1), "hooked_step_ms": round(hooked_ms, 1),
        "groups": {k: {"ms": round(v["ms"], 2), "calls": v["calls"]} for k, v in groups.items()},
        "top": [{"symbol": s, "ms": round(sum(ts) * 1e3, 2), "calls": len(ts)} for s, ts in top],
    }


if __name__ == "__main__":
    for a in sys.argv[1:]:
        try:
            print(json.dumps(profile(a)), flush=True)
        except Exception as e:  # report and go on with the next artifact
            print(json.dumps({"artifact": Path(a).name, "error": f"{type(e).__name__}: {e}"[:600]}), flush=True)
