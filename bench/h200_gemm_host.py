"""Host cost of one GEMM call on the GPU machine, split into its parts (no profiler there).

    python3 bench/h200_gemm_host.py        (runtime-only TVM; no torch)

Times N back-to-back calls (no synchronization; thin shapes, so the GPU keeps up) of:
the registered `lorac.gemm_nt` through TVM's FFI (what the VM calls), runtime.gemm_cuda.gemm
from Python, the bare ctypes cuBLAS call with fixed arguments, TVMFFIEnvGetStream, and a
ctypes call of cudaGetLastError (the floor of any ctypes call). Prints microseconds each.
"""
from __future__ import annotations

import ctypes
import json
import sys
import time

sys.modules["torch"] = None


def per_call_us(fn, n: int = 3000) -> float:
    for _ in range(100):
        fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return round((time.perf_counter() - t) / n * 1e6, 2)


def main() -> None:
    import numpy as np
    import tvm
    import tvm_ffi

    from lorac.runtime.devices.cuda import loader as cuda_loader
    from lorac.runtime.engine import gemm
    from lorac.runtime.devices.cuda import cublas as gemm_cuda
    from lorac.runtime.devices.cuda import cudart

    cuda_loader._ensure_cuda_device_api()
    gemm.register()
    dev = tvm.cuda(0)
    import ml_dtypes
    a = tvm.runtime.tensor(np.zeros((512, 1024), ml_dtypes.bfloat16), dev)
    b = tvm.runtime.tensor(np.zeros((16, 1024), ml_dtypes.bfloat16), dev)
    out = tvm.runtime.tensor(np.zeros((512, 16), np.float32), dev)
    ffi_gemm = tvm_ffi.get_global_func("lorac.gemm_nt")
    gemm_cuda.gemm(False, True, a, b, out)
    dev.sync()
    f, h = gemm_cuda._fn, gemm_cuda._handle
    key = (False, True, (512, 1024), (16, 1024), (512, 16), "bfloat16", "bfloat16", "float32")
    opb, opa, n_, m_, k_, bt, ldb, sb, at, lda, sa, ot, ldc, sc, batch = gemm_cuda._plan(*key)
    pa, pb, po = a.data_ptr(), b.data_ptr(), out.data_ptr()
    one, zero = gemm_cuda._ONE, gemm_cuda._ZERO

    def bare():
        f(h, opb, opa, n_, m_, k_, ctypes.byref(one), pb, bt, ldb, sb, pa, at, lda, sa, ctypes.byref(zero),
          po, ot, ldc, sc, batch, 68, -1)

    rt = cudart.runtime()
    r = {
        "ffi_registered_gemm_us": per_call_us(lambda: ffi_gemm(a, b, out)),
        "python_gemm_cuda_us": per_call_us(lambda: gemm_cuda.gemm(False, True, a, b, out)),
        "bare_ctypes_cublas_us": per_call_us(bare),
        "get_stream_us": per_call_us(lambda: gemm_cuda._get_stream(2, 0)),
        "ctypes_cudaGetLastError_us": per_call_us(rt.cudaGetLastError),
        "data_ptr_x3_us": per_call_us(lambda: (a.data_ptr(), b.data_ptr(), out.data_ptr())),
        "shape_dtype_key_us": per_call_us(lambda: (tuple(a.shape), tuple(b.shape), tuple(out.shape), str(a.dtype), str(b.dtype))),
        "device_type_us": per_call_us(lambda: out.device.dlpack_device_type()),
    }
    dev.sync()
    print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
