"""The GEMMs that compiled artifacts call, registered as TVM global functions.

The compiler (lorac.compiler.passes.gemm) turns every matmul into a call of `lorac.gemm_<ta><tb>`
with row-major operands and a preallocated output (destination-passing style); a `t`
means "read this operand with its last two axes swapped":

    out[..., M, N] = op_a(a)[..., M, K] @ op_b(b)[..., K, N]

and every sum of GEMMs the compiler fused (compiler/passes/gemm_sum.py) into a call of
`lorac.gemm_acc_<layouts>(a1, b1, a2, b2, ..., out)`: the first GEMM writes `out`, the
others add into it. One registered function per layout dispatches on the output's
device to that runtime device's GEMM library (runtime/devices/: numpy's BLAS on the
CPU, runtime/devices/cpu/blas.py; cuBLAS on CUDA, runtime/devices/cuda/cublas.py).
"""
from __future__ import annotations

from .. import devices
from ..errors import LoracError

_registered = False
_by_dlpack: dict = {}  # DLPack device type -> that device's gemm function


def _gemm_of(tensor):
    kind = tensor.device.dlpack_device_type()
    fn = _by_dlpack.get(kind)
    if fn is None:
        dev = devices.of_dlpack(int(kind))
        fn = getattr(dev, "gemm", None) if dev is not None else None
        if fn is None:
            raise LoracError(f"no GEMM library for tensors on {tensor.device}")
        _by_dlpack[kind] = fn
    return fn


def _layout(ta: bool, tb: bool):
    def call(a, b, out):
        _gemm_of(out)(ta, tb, a, b, out)
    return call


def _accumulating(layouts: list[tuple[bool, bool]]):
    def call(*args):
        out = args[-1]
        gemm = _gemm_of(out)
        for i, (ta, tb) in enumerate(layouts):
            gemm(ta, tb, args[2 * i], args[2 * i + 1], out, accumulate=i > 0)
    return call


def register_accumulating(names) -> None:
    """Register the accumulating GEMMs an artifact calls (manifest gemm.accumulating)."""
    import tvm_ffi

    for name in names:
        letters = name.rsplit("_", 1)[1]
        if not name.startswith("lorac.gemm_acc_") or len(letters) % 2 or set(letters) - {"n", "t"}:
            raise LoracError(f"artifact calls an unknown GEMM function {name!r}")
        layouts = [(letters[i] == "t", letters[i + 1] == "t") for i in range(0, len(letters), 2)]
        tvm_ffi.register_global_func(name, _accumulating(layouts), override=True)


def register() -> None:
    """Register the four layouts (once per process; override=True so a re-import of this
    module, e.g. under another package path in tests, does not fail)."""
    import tvm_ffi

    global _registered
    if _registered:
        return
    for ta in (False, True):
        for tb in (False, True):
            name = "lorac.gemm_" + ("t" if ta else "n") + ("t" if tb else "n")
            tvm_ffi.register_global_func(name, _layout(ta, tb), override=True)
    _registered = True
