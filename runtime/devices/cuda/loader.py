"""Make a runtime-only TVM able to load a lorac CUDA artifact.

Two things TVM's runtime-only mode lacks (NOTES.md, seen on the H200):
- the CUDA device API lives in `libtvm_runtime_cuda.so`, which only the compiler library
  pulls in: load it ourselves, after libcudart (RTLD_GLOBAL, so its symbols resolve);
- a CUDA library built by TVM 0.27 holds kernel *source* and asks the global callback
  `tvm_callback_cuda_compile(source)` for device code at load time. The compiler already
  compiled that source with nvcc (compiler/targets/cuda/__init__.py); lorac's callback
  (core/cuda_kernels.py) returns the artifact's fatbin when the source's sha256 matches the
  manifest. No NVRTC, no nvcc.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

from lorac.core import cuda_kernels

from ...errors import LoracError


def _ensure_cuda_device_api() -> None:
    import tvm_ffi

    if tvm_ffi.get_global_func("device_api.cuda", allow_missing=True) is not None:
        return
    from .cudart import load_library
    load_library("libcudart")
    import tvm
    lib = Path(tvm.__file__).parent / "lib" / "libtvm_runtime_cuda.so"
    if not lib.is_file():
        raise LoracError(f"TVM's CUDA runtime library is missing ({lib}); install the apache-tvm wheel with CUDA")
    try:
        ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
    except OSError as e:
        raise LoracError(f"cannot load TVM's CUDA runtime ({e}); is the NVIDIA driver installed?") from None


def prepare(art_dir: Path, manifest) -> None:
    """Load the CUDA runtime pieces and register this artifact's fatbin (`manifest`: a
    lorac.core.manifest.Manifest)."""
    extra = manifest.extra
    fatbin = Path(art_dir) / extra.get("cuda_fatbin", "kernels.fatbin")
    if "cuda_source_sha256" not in extra or not fatbin.is_file():
        raise LoracError(f"{art_dir}: CUDA artifact without its compiled kernels ({fatbin.name})")
    _ensure_cuda_device_api()
    cuda_kernels.add({extra["cuda_source_sha256"]: fatbin.read_bytes()})
