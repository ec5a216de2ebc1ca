"""NVIDIA CUDA (sm_90 by default): DLight-scheduled TVM kernels, GEMMs on cuBLAS, device
code compiled here with nvcc and shipped in the artifact.

TVM 0.27's CUDA build keeps the kernels as CUDA *source* inside the library and compiles
them when the module is loaded (callback `tvm_callback_cuda_compile`, NVRTC by default),
which fails in a runtime-only TVM and needs NVRTC or nvcc on the GPU machine. Instead we
take that source from the built module now, compile it with this machine's nvcc (no GPU
or driver needed) into `kernels.fatbin` (SASS for the arch + PTX for newer GPUs), and the
runtime answers the load-time callback with those bytes when the source's sha256 matches
(lorac.core.cuda_kernels, installed by lorac.runtime.devices.cuda.loader). The GPU machine then
needs only the driver, libcudart and libcublas.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

from lorac.core.errors import LoracError

from .fatbin import DEFAULT_ARCH, _nvcc, compile_fatbin, cuda_sources  # noqa: F401 - target interface
from .schedule import first_rules

FAMILY = "cuda"
DEVICE = "cuda"
GEMM_LIBRARY = True  # cuBLAS through lorac.runtime.devices.cuda.cublas
ARENA_PLAN = True  # one arena for the planned tensors (compiler/memory_plan.py)
# sums of GEMM results as one cuBLAS chain with beta = 1 (gemm_sum.py); not on the CPU, where
# TVM's add kernels run on every core and numpy's accumulate would run on one
ACCUMULATING_GEMMS = True
DTYPES = ("float32", "bfloat16")


def tvm_target(request: dict):
    import tvm
    spec = {k: v for k, v in request.items() if k not in ("kind", "cuda_graph")}
    spec.setdefault("arch", DEFAULT_ARCH)
    return tvm.target.Target({"kind": "cuda", **spec, "host": {"kind": "llvm"}})


def pass_config(request: dict) -> dict:
    """{"kind": "cuda", "cuda_graph": True}: TVM's RewriteCUDAGraph lifts the static parts of
    the step into CUDA graphs captured on the first call and replayed after; the cuBLAS
    calls join TVM's capture stream (runtime/devices/cuda/cublas.py), so replays skip Python."""
    return {"relax.backend.use_cuda_graph": binds_inputs(request)}


def binds_inputs(request: dict) -> bool:
    """Whether the build captures its inputs' device addresses into CUDA graphs.

    RewriteCUDAGraph only lifts work whose arguments are *static*; without the function
    attribute `num_input` no parameter is, so every kernel reading a weight or a LoRA
    tensor stayed outside the graphs (a 2-layer step had 26 small graphs and 108 GEMMs
    left in the VM). With num_input = 0 every input counts as static and a whole step
    becomes a few graphs, leaving outside only the GEMMs that write the step's outputs.
    The price: replays read the addresses seen at capture, so the runtime keeps one
    device buffer per input and copies each call's inputs into them (artifact.py,
    manifest `bound_inputs`)."""
    return bool(request.get("cuda_graph", False))


def native_units(dtype: str) -> dict:
    """Mamba's selective scan units become lorac's own TIR kernels in both dtypes
    (compiler/units/scan.py); bf16 builds map the attention units to cuDNN's fused SDPA
    (compiler/targets/cuda/attention.py) and SwiGLU's backward to one kernel per call (compiler/units/swiglu.py);
    cuDNN has no fp32 SDPA, so fp32 builds inline them as TVM kernels. The optimizer's
    AdamWStep updates its bucket in place in one kernel (compiler/units/adamw.py; its graph is fp32).
    Offloaded checkpoints go to pinned host memory and back (compiler/units/offload.py)."""
    from ...units.adamw import converters as adamw
    from ...units.offload import converters as offload
    from ...units.scan import converters as scan
    if dtype != "bfloat16":
        return {**scan(gpu=True), **adamw(), **offload(dtype)}
    from .attention import Narrowing, converters as attention
    from ...units.swiglu import converters as swiglu
    cache = Narrowing()  # one for the graph: offloaded attention values are the ones cuDNN reads
    return {**attention(cache), **scan(gpu=True, narrow="bfloat16"), **swiglu("bfloat16"), **adamw(),
            **offload(dtype, cache)}


def check_environment(request: dict) -> None:
    if _nvcc() is None:
        raise LoracError("target cuda needs nvcc (the CUDA toolkit) on the compiling machine "
                         "to turn TVM's kernels into a fatbin")


def prepare(mod):
    return mod


def tune(mod, target, trials: int, cache_dir):
    """--tune: MetaSchedule on this machine's GPU for the kernels TVM generates, records kept
    in cache_dir (compiler/tune.py, tuning.py)."""
    from .tuning import TUNER
    from ...tune import tune as ms_tune

    return ms_tune(mod, target, trials, cache_dir, TUNER, relax_passes)


def relax_passes(target) -> list:
    """The stock CUDA phases: legalize + fuse + tuned schedules (--tune) + DLight (lorac's
    vectorized elementwise and warp-per-row rules first (compiler/targets/_gpu_schedule.py), then
    Matmul/GEMV/Reduction/Fallback; a rule that raises falls through to the next:
    compiler/targets/_gpu_generic.py), lower."""
    from tvm.relax.backend.cuda import pipeline as cuda

    from .tuning import TUNER
    from .._gpu_generic import legalize_passes
    from ...tune import ApplyTuned

    return (cuda.library_dispatch_passes(target)
            + legalize_passes(target, first_rules(), tuned=ApplyTuned(target, TUNER))
            + cuda.dataflow_lower_passes(target) + cuda.finalize_passes(target))


def _arch(target) -> str:
    return str(target.attrs.get("arch", DEFAULT_ARCH)) if hasattr(target, "attrs") else DEFAULT_ARCH


def export_units(unit_calls: list, art_dir: Path, target) -> dict:
    """The packed attention kernels of the build's calls (mask "kernel"), compiled by Triton into
    cubins in art_dir (packed_build.py): the manifest's `packed_kernels`."""
    from . import packed_build
    built = packed_build.export(unit_calls, art_dir, _arch(target))
    return {"packed_kernels": built} if built else {}


def export(ex, art_dir: Path, target) -> dict:
    sources = cuda_sources(ex)
    if len(sources) != 1:
        raise LoracError(f"expected one CUDA module in the build, found {len(sources)}")
    arch = _arch(target)
    compile_fatbin(sources[0], arch, Path(art_dir) / "kernels.fatbin")
    ex.export_library(str(Path(art_dir) / "lib.so"))
    return {"library": "lib.so", "cuda_fatbin": "kernels.fatbin", "cuda_arch": arch,
            "cuda_source_sha256": hashlib.sha256(sources[0].encode()).hexdigest()}
