"""The packed attention kernels (packed_kernels.py) compiled ahead of time by Triton into cubins
beside a CUDA artifact's library, for each packed call shape the build makes (mask "kernel",
compiler/targets/cuda/attention.py). Triton compiles for a GPU architecture without a GPU or
a driver, with its own ptxas; the runtime loads the cubins through the CUDA driver
(runtime/devices/cuda/kernels.py) and needs no Triton.

Block configurations (BM, BN, num_warps, num_stages): each kernel's fastest on an H100 at the
Qwen3-0.6B shape 8x1024 (GQA 16/8, Dh 128), rows of 4-40 documents and of 24-40, out of the
ones bench/packed_kernels_bench.py times (docs/BENCHMARKS.md).
"""
from __future__ import annotations

import tempfile
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

from lorac.core.constants import PACKED_KERNEL_HEAD_DIMS as HEAD_DIMS
from lorac.core.errors import LoracError

CONFIGS = {"fwd": (64, 64, 4, 3), "delta": (128, 0, 4, 1), "bwd_kv": (32, 64, 4, 3), "bwd_q": (64, 64, 4, 3)}
# each kernel's arguments after the constexprs are taken out: name -> the kind ("ptr": a tensor,
# "f32", "i32") and Triton's type for it; POS's element type is the call's
_ARGS = {
    "fwd": ("Q", "K", "V", "POS", "O", "LSE", "scale", "S"),
    "delta": ("O", "DO", "DELTA", "S"),
    "bwd_kv": ("Q", "K", "V", "DO", "LSE", "DELTA", "POS", "DK", "DV", "scale", "S"),
    "bwd_q": ("Q", "K", "V", "DO", "LSE", "DELTA", "POS", "DQ", "scale", "S"),
}
_FP32 = {"LSE", "DELTA"}
_POS_TYPES = {"int64": "*i64", "int32": "*i32"}


@lru_cache(maxsize=1)
def unavailable() -> str | None:
    """Why the kernels cannot be built here (None: they can)."""
    try:
        import triton  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
    except ImportError as e:
        return f"Triton is not installed ({e}); pip install 'lorac[cuda]'"
    return None


def capability(arch: str) -> int:
    """sm_90 / sm_90a -> 90."""
    digits = "".join(ch for ch in str(arch).removeprefix("sm_") if ch.isdigit())
    if not digits:
        raise LoracError(f"CUDA arch {arch!r}: expected sm_XY")
    return int(digits)


def params(name: str) -> tuple:
    """The kinds of a kernel's arguments, in order (runtime/devices/cuda/kernels.py)."""
    return tuple("f32" if a == "scale" else "i32" if a == "S" else "ptr" for a in _ARGS[name])


def _signature(name: str, pos_dtype: str) -> dict:
    if pos_dtype not in _POS_TYPES:
        raise LoracError(f"packed attention: position ids of {pos_dtype}; the kernels take {', '.join(_POS_TYPES)}")
    sig = {}
    for a in _ARGS[name]:
        sig[a] = ("fp32" if a == "scale" else "i32" if a == "S" else "*fp32" if a in _FP32
                  else _POS_TYPES[pos_dtype] if a == "POS" else "*bf16")
    return sig


@contextmanager
def _private_cache():
    """Triton's compile cache in a temporary folder, removed after: nothing is written to
    ~/.triton or anywhere else outside the artifact."""
    import triton
    with tempfile.TemporaryDirectory(prefix="lorac-triton-") as tmp, triton.knobs.cache.scope():
        triton.knobs.cache.dir = tmp
        yield


def compile_kernel(name: str, H: int, KH: int, Dh: int, S: int, pos_dtype: str, arch: str):
    """Triton's compiled kernel (its .asm["cubin"] and .metadata) of one kernel at one shape."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from . import packed_kernels

    BM, BN, warps, stages = CONFIGS[name]
    sig = _signature(name, pos_dtype)
    consts = {"H": H, "D": Dh, "BM": BM, **({} if name == "delta" else {"KH": KH, "BN": BN})}
    # tensors 16-byte aligned (TVM's allocations are); S too when it is a multiple of 16
    aligned = [i for i, a in enumerate(sig) if sig[a].startswith("*") or (a == "S" and S % 16 == 0)]
    src = ASTSource(getattr(packed_kernels, name), signature={**sig, **{c: "constexpr" for c in consts}},
                    constexprs=consts, attrs={(i,): [["tt.divisibility", 16]] for i in aligned})
    with _private_cache():
        k = triton.compile(src, target=GPUTarget("cuda", capability(arch), 32),
                           options={"num_warps": warps, "num_stages": stages, "enable_fp_fusion": True})
    md = k.metadata
    if getattr(md, "global_scratch_size", 0) or getattr(md, "profile_scratch_size", 0):
        raise LoracError(f"packed attention kernel {name} needs Triton scratch memory; the runtime passes none")
    return k


def supports(H: int, KH: int, Dh: int) -> bool:
    """Whether the kernels take a call of these heads and head size."""
    return Dh in HEAD_DIMS and KH > 0 and H % KH == 0


def check_shape(H: int, KH: int, Dh: int) -> None:
    if not supports(H, KH, Dh):
        raise LoracError(f"packed attention kernels: {H} query heads over {KH} key heads of {Dh}; they take "
                         f"head sizes {', '.join(map(str, HEAD_DIMS))} and key heads dividing the query heads")


BACKWARD = ("delta", "bwd_kv", "bwd_q")


def export(calls: list, out_dir: Path, arch: str) -> list:
    """Compile the kernels of every packed call with mask "kernel" into out_dir: the manifest's
    `packed_kernels` entries, one per (H, KH, Dh, S, pos dtype), each with the forward kernel
    and, where a backward call has that shape, the backward's three."""
    shapes: dict = {}
    for call in calls:
        if call.get("mask") == "kernel":
            shape = (call["H"], call["K"], call["Dh"], call["S"], call["pos_dtype"])
            shapes.setdefault(shape, set()).add("bwd" if call["function"].endswith("bwd") else "fwd")
    out = []
    for (H, KH, Dh, S, pos_dtype), kinds in shapes.items():
        check_shape(H, KH, Dh)
        entry = {"H": H, "K": KH, "Dh": Dh, "S": S, "pos_dtype": pos_dtype, "kernels": {}}
        for name in ("fwd",) + (BACKWARD if "bwd" in kinds else ()):
            k = compile_kernel(name, H, KH, Dh, S, pos_dtype, arch)
            file = f"packed_{H}_{KH}_{Dh}_{S}_{pos_dtype}_{name}.cubin"
            (Path(out_dir) / file).write_bytes(k.asm["cubin"])
            BM, BN, warps, _ = CONFIGS[name]
            entry["kernels"][name] = {"file": file, "entry": k.metadata.name, "shared": int(k.metadata.shared),
                                      "warps": warps, "BM": BM, "BN": BN, "args": list(_ARGS[name]),
                                      "params": list(params(name))}
        out.append(entry)
    return out
