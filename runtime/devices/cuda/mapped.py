"""Frozen tables that wait in pinned host memory, read by the GPU in place (--offload-embeddings).

An untied model's input embedding is read only by the lookup of the step's tokens (no LoRA on it,
no gradient): T rows of its V. Held in page-locked host memory mapped into the GPU's address space
(cudaHostAllocMapped), the compiled lookup kernel reads those rows over PCIe (at Llama-3-8B's 4x2048,
8192 rows of 8 KB: 67 MB a step, ~1.05 GB of GPU memory freed), with no copy to issue and nothing
else changed: the CUDA graph captures the kernel as it is.

    t, host = host_table((V, D), "bfloat16")   # t: a CUDA tensor any artifact takes; host: numpy view
    host[...] = weights                         # filled once, before the first step
"""
from __future__ import annotations

import ctypes

import numpy as np

from lorac.core.dtypes import as_dtype

from ...errors import LoracError
from .. import _dlpack as dlpack
from .cudart import runtime

_MAPPED, _PORTABLE = 0x02, 0x01  # cudaHostAllocMapped | cudaHostAllocPortable


def host_table(shape, dtype: str, device_id: int = 0):
    """(a TVM tensor on CUDA device `device_id` whose memory is pinned host memory, a numpy array
    over the same bytes to fill it). The memory is freed when TVM drops the tensor."""
    rt = runtime()
    n = dlpack.nbytes(shape, dtype)
    host = ctypes.c_void_p()
    status = rt.cudaHostAlloc(ctypes.byref(host), max(n, 1), _MAPPED | _PORTABLE)
    if status != 0:
        raise LoracError(f"--offload-embeddings: pinning {n / 1e9:.2f} GB of host memory failed (CUDA error "
                         f"{status}); run with --offload-embeddings off")
    dev = ctypes.c_void_p()
    status = rt.cudaHostGetDevicePointer(ctypes.byref(dev), host, 0)
    if status != 0:
        rt.cudaFreeHost(host)
        raise LoracError(f"--offload-embeddings: the GPU cannot map pinned host memory (CUDA error {status}); "
                         "run with --offload-embeddings off")
    view = np.frombuffer((ctypes.c_byte * n).from_address(host.value), as_dtype(dtype)).reshape(shape)
    tensor = dlpack.wrap(dev.value, (2, device_id), shape, dtype, release=lambda _: rt.cudaFreeHost(host))
    return tensor, view
