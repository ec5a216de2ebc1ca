"""CUDA device code by source: the one `tvm_callback_cuda_compile` lorac installs.

A CUDA library built by TVM 0.27 holds kernel *source* and asks that global callback for
device code when it is loaded. Both stages hand it code compiled ahead by nvcc, keyed by the
source's sha256: the runtime an artifact's fatbin (runtime/devices/cuda/loader.py), tuning the
fatbins of the candidates it builds and times (compiler/targets/cuda/tune.py), which also gives a
`compile_missing(source)` for sources TVM asks for before their round was compiled. Without
one, an unknown source is an error: the runtime machine has neither NVRTC nor nvcc. Here so
that the compiler and the runtime share one registry without importing each other; tvm_ffi
is imported only when the callback is installed."""
from __future__ import annotations

import hashlib

from .errors import LoracError

_fatbins: dict[str, bytes] = {}  # sha256 of CUDA source -> fatbin
_compile_missing = None  # source -> fatbin, for sources nothing registered (tuning only)


def source_key(source: str) -> str:
    return hashlib.sha256(source.encode()).hexdigest()


def has(key: str) -> bool:
    return key in _fatbins


def add(fatbins: dict, compile_missing=None) -> None:
    """Register device code (source sha256 -> fatbin) and install the callback; with
    `compile_missing`, sources without a fatbin are compiled through it from now on."""
    global _compile_missing
    _fatbins.update(fatbins)
    if compile_missing is not None:
        _compile_missing = compile_missing
    import tvm_ffi
    # override: a full TVM registers its own NVRTC/nvcc callback at import
    tvm_ffi.register_global_func("tvm_callback_cuda_compile", _callback, override=True)


def _callback(source: str, *_target) -> bytes:
    key = source_key(source)
    hit = _fatbins.get(key)
    if hit is None and _compile_missing is not None:
        hit = _fatbins[key] = _compile_missing(source)
    if hit is None:
        raise LoracError("CUDA kernels of this artifact differ from the ones compiled ahead "
                         f"(source sha256 {key[:12]}); recompile the artifact with `lorac compile`")
    return bytes(hit)
