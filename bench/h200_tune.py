"""`--tune` on the GPU: MetaSchedule for the CUDA kernels TVM generates, and what it gains.

    source bench/h200_env.sh compiler          # the full TVM (its compiler library carried) and nvcc
    python3 bench/h200_tune.py CACHE TRIALS CASE [CASE ...]

For each case of bench/h200_vs_peers.py: compiles the training step with default schedules
and with `tune=TRIALS` (the Engine's `lorac compile --tune`: MetaSchedule on this GPU, the
database in CACHE/CASE/.lorac-tuning/cuda-tuning.json), then times both full steps
(h200_vs_peers.lorac_case: the compiled step, the loss read back, the LoRA+ AdamW update),
each in a process of its own, alternating default, tuned, default, tuned. Prints the tuning
time, the database's gains per kernel group (kernels named by their fused ops; time = calls
per step x microseconds) and one JSON line per case.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))


def compile_both(cache: str, case: str, trials: int) -> dict:
    from h200_vs_peers import _engine
    seconds = {}
    for tune in (0, trials):
        eng, _, _ = _engine(case, cache, tune=tune)
        t0 = time.perf_counter()
        eng.compile("train")
        eng.compile("adamw")
        seconds[f"tune{tune}"] = round(time.perf_counter() - t0, 1)
    return seconds


def group(task: str) -> str:
    """'fused_cast1_multiply2_multiply_sum' -> 'cast+multiply+sum'."""
    ops = [re.sub(r"\d+$", "", p) for p in task.removeprefix("fused_").split("_")]
    return "+".join(dict.fromkeys(o for o in ops if o))


def gains(db_path: Path) -> dict:
    (section,) = json.loads(db_path.read_text()).values()
    groups: dict = defaultdict(lambda: {"kernels": 0, "kept": 0, "default_us": 0.0, "tuned_us": 0.0})
    for e in section.values():
        if e.get("default_us") is None:
            continue
        g = groups[group(e["task"])]
        calls = e.get("calls", 1)
        g["kernels"] += 1
        g["kept"] += e["record"] is not None
        g["default_us"] += calls * e["default_us"]
        g["tuned_us"] += calls * (e["tuned_us"] if e["record"] else e["default_us"])
    return dict(sorted(groups.items(), key=lambda kv: -kv[1]["default_us"]))


def timed(cache: str, case: str, tune: int) -> dict:
    r = subprocess.run([sys.executable, str(HERE / "h200_vs_peers.py"), "lorac", cache, case, str(tune)],
                       capture_output=True, text=True, timeout=600)
    for line in r.stdout.splitlines():
        if line.startswith("{"):
            return json.loads(line)
    return {"error": (r.stderr.strip().splitlines() or ["?"])[-1][:400]}


def main(cache: str, trials: int, cases: list[str]) -> None:
    import logging
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("tvm").setLevel(logging.WARNING)  # MetaSchedule's per-trial traces
    for case in cases:
        where = str(Path(cache) / case)
        secs = compile_both(where, case, trials)
        print(f"{case}: compile s {secs}", flush=True)
        runs = [timed(where, case, tune) for tune in (0, trials, 0, trials)]
        for tune, r in zip((0, trials, 0, trials), runs):
            print(f"{case} tune={tune}: " + json.dumps({k: r.get(k) for k in ("step_ms", "parts_ms", "mem_gb",
                                                                                   "losses", "error")}), flush=True)
        by = {t: [r["step_ms"] for r in runs[i::2] if "step_ms" in r] for i, t in enumerate((0, trials))}
        table = gains(Path(where) / ".lorac-tuning" / "cuda-tuning.json")
        print("\n| kernel group | kernels tuned | kept | default us/step | tuned us/step |\n|---|---|---|---|---|")
        for name, g in table.items():
            print(f"| {name} | {g['kernels']} | {g['kept']} | {g['default_us']:.0f} | {g['tuned_us']:.0f} |")
        total_d = sum(g["default_us"] for g in table.values())
        total_t = sum(g["tuned_us"] for g in table.values())
        print(json.dumps({"case": case, "trials": trials, "compile_s": secs, "step_ms_default": by[0],
                          "step_ms_tuned": by[trials], "kernels_tuned": sum(g["kernels"] for g in table.values()),
                          "kept": sum(g["kept"] for g in table.values()),
                          "tuned_kernels_us_default": round(total_d), "tuned_kernels_us_tuned": round(total_t)}),
              flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3:])
