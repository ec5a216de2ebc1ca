"""Relax passes shared by the GPU targets that have no vendor GEMM library in lorac
(OpenCL, WebGPU, ROCm, Metal): every op, matmuls included, is a TVM kernel scheduled by
DLight's default GPU rules (Matmul, GEMV, Reduction, GeneralReduction, Fallback)."""
from __future__ import annotations


def relax_passes(target) -> list:
    from tvm import relax
    from tvm.relax.backend.cuda import pipeline as gpu  # these phases are target-generic

    t = relax.transform
    finalize = [t.StaticPlanBlockMemory(), t.LowerAllocTensor(), t.KillAfterLastUse(), t.LowerRuntimeBuiltin(),
                t.ComputePrimValue(), t.VMShapeLower(), t.AttachGlobalSymbol()]  # CUDA's, minus CUDA graphs
    return (gpu.library_dispatch_passes(target) + gpu.legalize_passes(target)
            + gpu.dataflow_lower_passes(target) + finalize)


def compile_error(family: str, err: Exception):
    """Wrap a TVM build failure in one lorac error that names the target."""
    from lorac.runtime.errors import LoracError
    msg = str(err).strip().splitlines()
    return LoracError(f"TVM could not build for target {family}: {msg[-1] if msg else type(err).__name__}")
