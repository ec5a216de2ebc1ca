"""Lorac's own GPU kernels in a CUDA artifact: cubins the compiler wrote beside the library
(compiler/targets/cuda/packed_build.py: Triton kernels compiled ahead of time), loaded and
launched through the CUDA driver API by ctypes. Neither Triton nor torch is needed at run time.

    k = Kernel(cubin_bytes, "fwd", shared=114688, warps=4, params=("ptr",) * 6 + ("f32", "i32"))
    k.launch((gx, gy), [q_ptr, ..., scale, S], stream)

A kernel compiled by Triton takes its arguments (constexprs left out) followed by two scratch
pointers (global and profiling scratch), passed as null: the compiler refuses kernels that
need either. Launches go to the stream given (TVM's, a capture stream while a CUDA graph
records), so captured steps replay them like the GEMMs and cuDNN's calls.
"""
from __future__ import annotations

import ctypes

from ...errors import LoracError
from .cudart import runtime

_P, _UINT, _INT = ctypes.c_void_p, ctypes.c_uint, ctypes.c_int
SIGNATURES = {
    "cuModuleLoadData": [ctypes.POINTER(_P), ctypes.c_char_p],
    "cuModuleGetFunction": [ctypes.POINTER(_P), _P, ctypes.c_char_p],
    "cuFuncSetAttribute": [_P, _INT, _INT],
    "cuLaunchKernel": [_P, _UINT, _UINT, _UINT, _UINT, _UINT, _UINT, _UINT, _P, ctypes.POINTER(_P), ctypes.POINTER(_P)],
    "cuGetErrorString": [_INT, ctypes.POINTER(ctypes.c_char_p)],
}
MAX_DYNAMIC_SHARED = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
STATIC_SHARED_LIMIT = 48 * 1024  # past this a kernel must opt in to dynamic shared memory
SCRATCH_POINTERS = 2  # Triton's global and profiling scratch arguments, after the kernel's own
_ARG = {"ptr": _P, "f32": ctypes.c_float, "i32": ctypes.c_int32}
_driver: dict = {}


def driver() -> ctypes.CDLL:
    """libcuda (the driver every CUDA machine has), each call of SIGNATURES typed."""
    if "lib" not in _driver:
        lib = None
        for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
            try:
                lib = ctypes.CDLL(name)
                break
            except OSError:
                continue
        if lib is None:
            raise LoracError("this CUDA artifact launches its own kernels through the CUDA driver (libcuda); not found")
        for name, args in SIGNATURES.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = _INT, args
        _driver["lib"] = lib
    return _driver["lib"]


def check(code: int, what: str) -> None:
    if code != 0:
        msg = ctypes.c_char_p()
        driver().cuGetErrorString(code, ctypes.byref(msg))
        raise LoracError(f"CUDA driver: {what} failed: {(msg.value or b'error %d' % code).decode()}")


class Kernel:
    """One kernel of a cubin: `params` the kinds of its own arguments ("ptr", "f32", "i32")."""

    def __init__(self, cubin: bytes, name: str, shared: int, warps: int, params: tuple, device_index: int = 0):
        rt, lib = runtime(), driver()
        if rt.cudaSetDevice(device_index) != 0:  # the runtime's primary context, current on this thread
            raise LoracError(f"cannot select CUDA device {device_index}")
        self.name, self.shared, self.threads, self.params = name, int(shared), 32 * int(warps), tuple(params)
        self._cubin = ctypes.create_string_buffer(cubin, len(cubin))  # the module's image, kept alive
        self._module, self._function = _P(), _P()
        check(lib.cuModuleLoadData(ctypes.byref(self._module), self._cubin), f"loading kernel {name}")
        check(lib.cuModuleGetFunction(ctypes.byref(self._function), self._module, name.encode()),
              f"finding kernel {name}")
        if self.shared > STATIC_SHARED_LIMIT:
            check(lib.cuFuncSetAttribute(self._function, MAX_DYNAMIC_SHARED, self.shared),
                  f"giving kernel {name} {self.shared} bytes of shared memory")

    def arguments(self, values: list) -> tuple:
        """(the ctypes values, the pointer array cuLaunchKernel takes) of `values` and the scratch."""
        if len(values) != len(self.params):
            raise LoracError(f"kernel {self.name} takes {len(self.params)} arguments, given {len(values)}")
        held = [_ARG[kind](v) for kind, v in zip(self.params, values)] + [_P(0) for _ in range(SCRATCH_POINTERS)]
        return held, (_P * len(held))(*[ctypes.cast(ctypes.byref(h), _P) for h in held])

    def launch(self, grid: tuple, values: list, stream) -> None:
        held, ptrs = self.arguments(values)
        gx, gy, gz = (tuple(int(g) for g in grid) + (1, 1))[:3]
        check(driver().cuLaunchKernel(self._function, gx, gy, gz, self.threads, 1, 1, self.shared, stream, ptrs, None),
              f"launching kernel {self.name}")
        del held  # the driver copied the arguments at the launch
