"""Does timing cuBLASLt's candidate algorithms beat cuBLAS's own pick on the step's GEMMs?

    python3 bench/h200_gemm_algos.py CACHE CASE [CANDIDATES]   (GPU machine; cases of h200_vs_peers.py)

Runs the case's first step with every cuBLAS call recorded (shape, layouts, dtypes, whether it
adds into its output), then times each distinct GEMM on fresh buffers: cublasGemmStridedBatchedEx
as lorac calls it today, and each of cuBLASLt's first CANDIDATES heuristic algorithms (default 8,
32 MiB workspace). Prints one line a shape (calls a step, ms each way, the winner's index) and the
step's GEMM time each way weighted by calls: the heuristic's pick, the best candidate.
"""
from __future__ import annotations

import ctypes
import json
import sys
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from h200_vs_peers import case_engine, full_step, pin_source  # noqa: E402

TORCH = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def timed(fn, reps: int = 20, warm: int = 3) -> float:
    for _ in range(warm):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main(cache: str, case: str, candidates: int = 8) -> None:
    import lorac.runtime.devices.cuda as cuda_dev
    import cublaslt
    from lorac.runtime.devices.cuda import cublas

    pin_source(cache)
    calls: Counter = Counter()
    inner = cuda_dev.gemm

    def recording(ta, tb, a, b, out, accumulate=False):
        calls[(ta, tb, tuple(a.shape), tuple(b.shape), tuple(out.shape), str(a.dtype), str(b.dtype),
               str(out.dtype), accumulate)] += 1
        inner(ta, tb, a, b, out, accumulate)

    cuda_dev.gemm = recording
    eng, _, optim, _, batches, _ = case_engine(cache, case)
    full_step(eng, optim, batches[0], 1)  # the capture: each GEMM of the step called once
    torch.cuda.synchronize()
    stream = torch.cuda.current_stream().cuda_stream
    cublas._lib.cublasSetStream_v2(cublas._handle, ctypes.c_void_p(stream))
    cublas._stream[0] = None  # lorac's next call sets its own stream again
    work = torch.empty(cublaslt.WORKSPACE, dtype=torch.uint8, device="cuda")
    total_default = total_best = total_first = 0.0
    for key, n in sorted(calls.items(), key=lambda kv: -kv[1]):
        ta, tb, sa, sb, so, da, db, do, acc = key
        a = torch.randn(sa, device="cuda").to(TORCH[da]) * 0.05
        b = torch.randn(sb, device="cuda").to(TORCH[db]) * 0.05
        out = torch.zeros(so, device="cuda", dtype=TORCH[do])
        plan = cublas._plan(ta, tb, sa, sb, so, da, db, do)
        opb, opa, pn, pm, k, bt, ldb, stb, at, lda, sta, ot, ldc, stc, batch = plan
        beta = ctypes.c_float(1.0 if acc else 0.0)

        def default():
            cublas._fn(cublas._handle, opb, opa, pn, pm, k, ctypes.byref(cublas._ONE), b.data_ptr(), bt, ldb, stb,
                       a.data_ptr(), at, lda, sta, ctypes.byref(beta), out.data_ptr(), ot, ldc, stc, batch,
                       cublas._COMPUTE_32F, cublas._GEMM_DEFAULT)
        t_default = timed(default)
        ref = None if acc else out.float().clone()  # out holds the default's result
        shape = cublaslt.Shape(plan, candidates)
        times = []
        for i in range(len(shape.algos)):
            times.append(timed(lambda i=i: shape.run(i, a.data_ptr(), b.data_ptr(), out.data_ptr(), beta,
                                                     work.data_ptr(), stream)))
            if ref is not None:
                shape.run(i, a.data_ptr(), b.data_ptr(), out.data_ptr(), beta, work.data_ptr(), stream)
                err = (out.float() - ref).abs().max().item() / max(ref.abs().max().item(), 1e-30)
                if err > 2e-2:
                    times[-1] = float("inf")  # a wrong result never wins
        best = min(range(len(times)), key=times.__getitem__)
        flop = 2 * k * pn * pm * batch
        total_default += n * t_default
        total_best += n * min(t_default, times[best])
        total_first += n * times[0]
        print(json.dumps({"calls": n, "a": list(sa), "b": list(sb), "out": list(so), "t": f"{int(ta)}{int(tb)}",
                          "dtypes": f"{da[:4]},{db[:4]}->{do[:4]}", "acc": acc, "default_ms": round(t_default, 4),
                          "lt_ms": [round(t, 4) for t in times], "best": best,
                          "tflops_default": round(flop / t_default / 1e9, 1),
                          "tflops_best": round(flop / min(t_default, times[best]) / 1e9, 1)}), flush=True)
        del a, b, out
    print(json.dumps({"case": case, "shapes": len(calls), "gemm_calls": sum(calls.values()),
                      "step_gemm_ms_default": round(total_default, 2), "lt_first_ms": round(total_first, 2),
                      "best_ms": round(total_best, 2), "saved_ms": round(total_default - total_best, 2)}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 8)
