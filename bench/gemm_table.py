"""Per GEMM shape of the CPU training step: GFLOP/s of each BLAS this host can run.

    .venv/bin/python bench/gemm_table.py [--cases 40m,smollm2] [--threads 2] [--reps 10]
        [--backends numpy,lorac:openblas,lorac,torch,numpy-1,mkl-1] [--json FILE]

1. shapes: compiles (or reuses) the fp32 training artifact of each case (the shapes of
   bench/bench_backends_cpu.py: 4x256 tokens, r=16 on all seven targets) and runs one step
   with the CPU GEMM library wrapped, recording every call: layout (ta, tb), batch, M, N, K,
   accumulate (`+=`: a later term of an accumulating call, beta = 1). Identical calls are
   counted, not repeated.
2. for each backend, in a fresh process (so no pool of one spins beside another), each
   shape timed `--reps` times after a warm-up, best of them (a shared host's quiet moments),
   and a 4096^3 square GEMM as the host's measured fp32 peak:
   - numpy: np.matmul as lorac ran GEMMs before, OpenBLAS with its own `--threads` threads;
   - numpy-1 / mkl-1: numpy's OpenBLAS / Intel MKL (the PyPI wheel `mkl`, cblas_sgemm through
     ctypes) on one thread, whole GEMMs: the libraries' per-core speed;
   - lorac: lorac's CPU GEMM library as the runtime runs it (runtime/devices/cpu/blas.py: the
     library and split it chooses per shape, its `--threads` threads); lorac:openblas and
     lorac:mkl restrict it to one library (LORAC_CPU_BLAS);
   - torch: torch.matmul (MKL/oneDNN inside torch, `--threads` threads), the reference ceiling;
     lorac's runtime never imports torch.
Prints one JSON line per (backend, case) and a table per case: shape, calls a step, GFLOP/s
per backend, the fastest backend and its fraction of the best measured peak, what lorac
chose, and the step's GEMM seconds per backend (sum over shapes of calls x time).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

PEAK_N = 4096


def collect_shapes(case: str, cache: str) -> list[dict]:
    """Every GEMM call of one training step of `case`, grouped: [{ta, tb, batch, m, n, k, acc, count}]."""
    sys.modules["torch"] = None
    from bench_backends_cpu import ALPHA, B, CASES, RANK, S, TARGETS
    from h200_check import device_inputs

    from lorac.compiler import compile_graph
    from lorac.graphs import ModelSpec, TrainSpec, build_training_graph
    from lorac.runtime.devices import cpu
    from lorac.runtime.engine.artifact import load_artifact

    spec = ModelSpec.from_hf_config(CASES[case])
    train = TrainSpec(batch=B, seq=S, rank=RANK, alpha=ALPHA, lora_targets=TARGETS)
    art = compile_graph(build_training_graph(spec, train), target="cpu", out_dir=Path(cache) / f"gemm-table-{case}")
    step = load_artifact(art, "cpu")
    calls: collections.Counter = collections.Counter()
    real = cpu.gemm

    def spy(ta, tb, a, b, out, accumulate=False):
        sa, so = tuple(a.shape), tuple(out.shape)
        k = sa[-2] if ta else sa[-1]
        batch = 1
        for d in so[:-2]:
            batch *= d
        calls[(bool(ta), bool(tb), batch, so[-2], so[-1], k, bool(accumulate), len(b.shape) == 2)] += 1
        real(ta, tb, a, b, out, accumulate)

    cpu.gemm = spy
    _, args = device_inputs(step)
    step(args, as_numpy=False)
    cpu.gemm = real
    return [dict(ta=ta, tb=tb, batch=bt, m=m, n=n, k=k, acc=acc, shared_b=sb, count=c)
            for (ta, tb, bt, m, n, k, acc, sb), c in sorted(calls.items(), key=lambda kv: -kv[0][3] * kv[0][4] * kv[0][5] * kv[0][2])]


def _operands(s: dict, np):
    rng = np.random.default_rng(0)
    bt, m, n, k = s["batch"], s["m"], s["n"], s["k"]
    lead = (bt,) if bt > 1 else ()
    a = rng.standard_normal(lead + ((k, m) if s["ta"] else (m, k)), dtype=np.float32)
    bl = () if s.get("shared_b", True) or bt == 1 else lead
    b = rng.standard_normal(bl + ((n, k) if s["tb"] else (k, n)), dtype=np.float32)
    return a, b, np.zeros(lead + (m, n), np.float32)


def _runner(backend: str, threads: int):
    """-> (call(ta, tb, a, b, out) on numpy arrays, description)."""
    import numpy as np
    if backend in ("numpy", "numpy-1"):  # numpy-1: OPENBLAS_NUM_THREADS=1 (set by main)
        def call(ta, tb, a, b, out):
            np.matmul(np.swapaxes(a, -1, -2) if ta else a, np.swapaxes(b, -1, -2) if tb else b, out=out)
        from lorac.runtime.devices.cpu.blas import blas_info
        np.ones((2, 2)) @ np.ones((2, 2))
        return call, blas_info()
    if backend.startswith("lorac"):  # lorac, lorac:openblas, lorac:mkl (LORAC_CPU_BLAS, set by main)
        import tvm  # noqa: F401 - as the runtime runs: TVM's pool exists (no spin)
        from lorac.runtime.devices.cpu import blas

        def call(ta, tb, a, b, out):
            blas.gemm(ta, tb, a, b, out)
        return call, blas.blas_info()
    if backend == "mkl-1":  # MKL, one thread, whole GEMMs
        from lorac.runtime.devices.cpu import cblas
        lib = cblas.mkl()
        if lib is None:
            raise SystemExit("mkl: libmkl_rt not found (pip install mkl)")

        def call(ta, tb, a, b, out):
            lib.sgemm(ta, tb, a, b, out)
        return call, lib.version
    if backend == "torch":
        import torch
        torch.set_num_threads(threads)

        def call(ta, tb, a, b, out):
            x, y = torch.from_numpy(a), torch.from_numpy(b)
            torch.matmul(x.transpose(-1, -2) if ta else x, y.transpose(-1, -2) if tb else y, out=torch.from_numpy(out))
        return call, f"torch {torch.__version__} ({torch.get_num_threads()} threads)"
    raise SystemExit(f"unknown backend {backend}")


def time_backend(backend: str, shapes: dict, threads: int, reps: int) -> dict:
    import numpy as np
    call, desc = _runner(backend, threads)
    out = {"backend": backend, "blas": desc, "gflops": {}}

    def timed(s, n):
        a, b, o = _operands(s, np)
        call(s["ta"], s["tb"], a, b, o)
        ts = []
        for _ in range(n):
            t = time.perf_counter()
            call(s["ta"], s["tb"], a, b, o)
            ts.append(time.perf_counter() - t)
        return 2.0 * s["batch"] * s["m"] * s["n"] * s["k"] / min(ts) / 1e9  # best of n: a shared host's quiet moments

    peak = dict(ta=False, tb=False, batch=1, m=PEAK_N, n=PEAK_N, k=PEAK_N)
    out["peak_gflops"] = round(max(timed(peak, 3) for _ in range(2)), 1)
    for key, s in shapes.items():
        out["gflops"][key] = round(timed(s, reps), 1)
    if backend.startswith("lorac"):  # what lorac chose per shape
        from lorac.runtime.devices.cpu import blas
        from lorac.runtime.devices.cpu import choice
        out["plans"] = {}
        for key, s in shapes.items():
            a, b, _ = _operands(s, np)
            out["plans"][key] = "/".join(choice.get(blas.shape_key(s["ta"], s["tb"], a.shape, b.shape, False)) or "?")
    return out


def _env(env: dict, backend: str) -> dict:
    if backend.endswith("-1"):
        return {**env, "OPENBLAS_NUM_THREADS": "1"}
    if backend.startswith("lorac:"):
        return {**env, "LORAC_CPU_BLAS": backend.split(":", 1)[1]}
    return env


def shape_key(s: dict) -> str:
    lay = ("t" if s["ta"] else "n") + ("t" if s["tb"] else "n")
    return f"{lay} {s['batch']}x{s['m']}x{s['n']}x{s['k']}" + (" +=" if s["acc"] else "")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="40m,smollm2")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--backends", default="numpy,lorac:openblas,lorac,torch,numpy-1,mkl-1")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--cache", default=".lorac-cache/bench")
    ap.add_argument("--json", help="write every result to this file too")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--shapes-file", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker == "shapes":
        print(json.dumps(collect_shapes(args.cases, args.cache)))
        return
    if args.worker:
        shapes = json.loads(Path(args.shapes_file).read_text())
        print(json.dumps(time_backend(args.worker, shapes, args.threads, args.reps)))
        return
    env = {**os.environ, "TVM_NUM_THREADS": str(args.threads), "OMP_NUM_THREADS": str(args.threads),
           "OPENBLAS_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    results = []
    for case in args.cases.split(","):
        r = subprocess.run([sys.executable, __file__, "--worker", "shapes", "--cases", case, "--cache", args.cache],
                           env=env, capture_output=True, text=True)
        if r.returncode:
            sys.exit(r.stderr[-3000:])
        shapes = {shape_key(s): s for s in json.loads(r.stdout.strip().splitlines()[-1])}
        path = Path(args.cache) / f"gemm-table-{case}.json"
        path.write_text(json.dumps(shapes))
        per = {}
        for backend in args.backends.split(","):
            r = subprocess.run([sys.executable, __file__, "--worker", backend, "--shapes-file", str(path),
                                "--threads", str(args.threads), "--reps", str(args.reps)],
                               env=_env(env, backend), capture_output=True, text=True)
            if r.returncode:
                print(json.dumps({"backend": backend, "case": case, "error": r.stderr.strip()[-500:]}), flush=True)
                continue
            per[backend] = json.loads(r.stdout.strip().splitlines()[-1])
            print(json.dumps({"case": case, "load": os.getloadavg()[0], **per[backend]}), flush=True)
        results.append({"case": case, "shapes": shapes, "backends": per})
        _table(case, shapes, per)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


def _table(case: str, shapes: dict, per: dict) -> None:
    names = list(per)
    peak = max((per[b]["peak_gflops"] for b in names), default=0)
    print(f"\n{case}: GFLOP/s per shape (layout batch x M x N x K); peak {PEAK_N}^3: "
          + ", ".join(f"{b} {per[b]['peak_gflops']}" for b in names))
    chosen = "lorac" if "plans" in per.get("lorac", {}) else next((b for b in names if "plans" in per[b]), None)
    print("| shape | calls | " + " | ".join(names) + " | best | best/peak |" + (f" {chosen} chose |" if chosen else ""))
    print("|---|---|" + "---|" * len(names) + "---|---|" + ("---|" if chosen else ""))
    secs = {b: 0.0 for b in names}
    for key, s in shapes.items():
        flop = 2.0 * s["batch"] * s["m"] * s["n"] * s["k"]
        g = {b: per[b]["gflops"][key] for b in names}
        for b in names:
            secs[b] += s["count"] * flop / (g[b] * 1e9)
        best = max(g, key=g.get)
        print(f"| {key} | {s['count']} | " + " | ".join(str(g[b]) for b in names)
              + f" | {best} | {g[best] / peak:.2f} |" + (f" {per[chosen]['plans'][key]} |" if chosen else ""))
    total = sum(s["count"] * 2.0 * s["batch"] * s["m"] * s["n"] * s["k"] for s in shapes.values())
    print(f"step GEMMs: {total / 1e9:.1f} GFLOP; seconds a step: "
          + ", ".join(f"{b} {secs[b]:.3f}" for b in names), flush=True)


if __name__ == "__main__":
    main()
