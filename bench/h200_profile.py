"""Where a compiled step's time goes on the GPU: GEMMs, TVM kernels, and the host.

    python3 bench/h200_profile.py ART_DIR [ART_DIR ...]   (runtime-only TVM; no torch)
    GPU_ONLY=1: only the CUDA-event view; PROFILE_TOP=N: how many calls it lists (default 10)

TVM 0.27's runtime has no profiler, so this uses the VM's instrument hook: around every
call the VM makes (a cuBLAS GEMM through lorac.gemm_*, a TVM kernel, a VM builtin) it
synchronizes the device and reads the clock. Each call's time then includes one launch and
one synchronization (`sync_us`, measured on an empty stream, is printed for scale). Besides
the grouped times it prints the plain step time (no hook) and how long the host takes to
enqueue one step, which is the floor of a step that the GPU cannot hide, and the same
hook without synchronizing (`host_groups`, `host_top`): what the host spends issuing each
call, and `input_marshal_ms`, the runtime's per-step input checks. On CUDA, `gpu`: CUDA
events around every call (no synchronization) give each call's GPU time; their sum is the
GPU's busy time, and wall time beyond it is the GPU waiting for the host.
"""
from __future__ import annotations

import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.modules["torch"] = None  # the runtime must not need torch
sys.path.insert(0, str(Path(__file__).parent))
from h200_check import device_inputs, time_step  # noqa: E402

from lorac.runtime.engine.artifact import load_artifact  # noqa: E402


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

    def timed_call(sync: bool) -> tuple[dict[str, list[float]], float]:
        """Run one step under a VM hook that times every call, synchronizing around each
        (device time included) or not (what the host spends issuing it): (symbol -> seconds
        of each call, ms of the whole hooked step)."""
        times: dict[str, list[float]] = defaultdict(list)
        clock = {}

        def hook(func, symbol, before, ret, *a):
            if sync:
                dev.sync()
            now = time.perf_counter()
            if before:
                clock["t"] = now
            else:
                times[symbol].append(now - clock["t"])
            return 0  # VMInstrumentReturnKind.kNoOp: run the call as usual

        step._vm.set_instrument(hook)
        step(args, as_numpy=False)  # warm the hook path
        dev.sync()
        times.clear()
        t0 = time.perf_counter()
        step(args, as_numpy=False)
        dev.sync()
        return times, (time.perf_counter() - t0) * 1e3

    if os.environ.get("GPU_ONLY"):  # CUDA events alone: the cheap view
        return {"artifact": Path(art).name, "step_ms": round(step_ms, 2), "gpu": _gpu_busy(step, args)}
    host, _ = timed_call(sync=False)
    t = time.perf_counter()
    for _ in range(5):
        [step._to_device(spec, args[spec["name"]]) for spec in step.inputs]
    marshal_ms = (time.perf_counter() - t) / 5 * 1e3
    gpu = _gpu_busy(step, args) if device == "cuda" else None
    per_symbol, hooked_ms = timed_call(sync=True)
    groups, top = _summary(per_symbol, 12)
    host_groups, host_top = _summary(host, 8)
    return {
        "artifact": Path(art).name, "step_ms": round(step_ms, 2), "enqueue_ms": round(enqueue_ms, 2),
        "sync_us": round(sync_us, 1), "hooked_step_ms": round(hooked_ms, 1),
        "groups": groups, "top": top, "host_groups": host_groups, "host_top": host_top,
        "input_marshal_ms": round(marshal_ms, 2),
        "gpu": gpu,
    }


def _summary(times: dict[str, list[float]], n: int) -> tuple[dict, list]:
    """(per group: ms and calls, the n symbols of most time) of a timed step."""
    groups: dict[str, dict] = defaultdict(lambda: {"ms": 0.0, "calls": 0})
    for sym, ts in times.items():
        g = groups[_group(sym)]
        g["ms"] += sum(ts) * 1e3
        g["calls"] += len(ts)
    top = sorted(times.items(), key=lambda kv: -sum(kv[1]))[:n]
    return ({k: {"ms": round(v["ms"], 2), "calls": v["calls"]} for k, v in groups.items()},
            [{"symbol": s, "ms": round(sum(ts) * 1e3, 2), "calls": len(ts)} for s, ts in top])


def _gpu_busy(step, args) -> dict:
    """GPU time of each VM call from CUDA events recorded around it on TVM's stream (no
    synchronization inside the step, so the step runs as it does untimed): the sum is the
    GPU's busy time, the rest of the step's wall time is the GPU waiting for the host."""
    import ctypes

    from lorac.runtime.devices.cuda.cudart import runtime, stream_getter

    rt, get_stream = runtime(), stream_getter()
    rt.cudaEventElapsedTime.argtypes = [ctypes.POINTER(ctypes.c_float), ctypes.c_void_p, ctypes.c_void_p]
    events: list = []
    marks: list = []  # (symbol, start event index, end event index)
    state = {"i": 0, "open": None}

    def event():
        if state["i"] == len(events):
            e = ctypes.c_void_p()
            rt.cudaEventCreate(ctypes.byref(e))
            events.append(e)
        e = events[state["i"]]
        state["i"] += 1
        rt.cudaEventRecord(e, get_stream(2, 0))
        return state["i"] - 1

    def hook(func, symbol, before, ret, *a):
        if before:
            state["open"] = event()
        else:
            if str(symbol).startswith("lorac.gemm") and a:  # GEMMs apart by output shape
                symbol = f"{symbol} {list(a[-1].shape)}"
            marks.append((symbol, state["open"], event()))
        return 0

    step._vm.set_instrument(hook)
    for _ in range(2):  # the first pass creates the events
        state["i"] = 0
        marks.clear()
        step._dev.sync()
        t = time.perf_counter()
        step(args, as_numpy=False)
        step._dev.sync()
        wall_ms = (time.perf_counter() - t) * 1e3
    ms = ctypes.c_float()
    per: dict[str, list[float]] = defaultdict(list)
    for sym, a, b in marks:
        rt.cudaEventElapsedTime(ctypes.byref(ms), events[a], events[b])
        per[sym].append(ms.value)
    first, last = marks[0][1], marks[-1][2]
    rt.cudaEventElapsedTime(ctypes.byref(ms), events[first], events[last])
    groups: dict[str, float] = defaultdict(float)
    for sym, ts in per.items():
        groups[_group(sym)] += sum(ts)
    top = sorted(per.items(), key=lambda kv: -sum(kv[1]))[:int(os.environ.get("PROFILE_TOP", "10"))]
    return {"wall_ms_with_events": round(wall_ms, 2), "first_to_last_event_ms": round(ms.value, 2),
            "busy_ms": round(sum(groups.values()), 2), "groups_ms": {k: round(v, 2) for k, v in groups.items()},
            "top": [{"symbol": s, "ms": round(sum(ts), 2), "calls": len(ts)} for s, ts in top]}


if __name__ == "__main__":
    for a in sys.argv[1:]:
        try:
            print(json.dumps(profile(a)), flush=True)
        except Exception as e:  # report and go on with the next artifact
            print(json.dumps({"artifact": Path(a).name, "error": f"{type(e).__name__}: {e}"[:600]}), flush=True)
