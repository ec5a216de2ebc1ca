"""WebGPU (browsers, wgpu): TVM's own kernels as WGSL, host code as wasm32 objects.

WGSL has no 64-bit integers (TVM: "CodeGenWebGPU: do not support i64"), so before the
build every int64 tensor in the Relax program becomes int32 (ids, labels, index math and
their constants: `narrow_int64`) and every kernel's index arithmetic is narrowed
(`ForceNarrowIndexToInt32`). The manifest then lists input_ids/labels as int32.

Artifact: `lib.tar`, the wasm32 object files with the WGSL shaders packed in, to be
linked into a page by TVM's web runtime (emscripten + tvmjs, `tvmjs.create_tvmjs_wasm`);
lorac's Python runtime does not run it.
"""
from __future__ import annotations

from pathlib import Path

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

FAMILY = "webgpu"
DEVICE = "webgpu"
GEMM_LIBRARY = False
DTYPES = ("float32",)

_ASTYPE = tvm.ir.Op.get("relax.astype")
_SHAPE_TO_TENSOR = tvm.ir.Op.get("relax.shape_to_tensor")


def tvm_target(request: dict):
    spec = {k: v for k, v in request.items() if k != "kind"}
    return tvm.target.Target({"kind": "webgpu", **spec,
                              "host": {"kind": "llvm", "mtriple": "wasm32-unknown-unknown-wasm"}})


def check_environment(request: dict) -> None:
    pass


@mutator
class _NarrowInt64(PyExprMutator):
    def __init__(self, mod, params: dict):
        super().__init__(mod)
        self.params = params

    def visit_var_(self, var):
        return self.params.get(var, var)

    def visit_generic_const_(self, const):
        value = const.value  # a tvm Tensor for tensor constants
        if hasattr(value, "numpy") and str(value.dtype) == "int64":
            return relax.const(value.numpy().astype("int32"), "int32")
        return const

    def visit_call_(self, call):
        new = super().visit_call_(call)
        if isinstance(new, relax.Call) and new.op == _ASTYPE and str(new.attrs.dtype) == "int64":
            return relax.op.astype(new.args[0], "int32")
        if isinstance(new, relax.Call) and new.op == _SHAPE_TO_TENSOR:
            return relax.op.astype(self.builder_.emit(new), "int32")
        return new


def narrow_int64(mod: tvm.IRModule) -> tvm.IRModule:
    func = mod["main"]
    params, new_params = {}, []
    for p in func.params:
        if isinstance(p.ty, relax.TensorType) and str(p.ty.dtype) == "int64":
            params[p] = relax.Var(p.name, relax.TensorType(p.ty.shape, "int32"))
        new_params.append(params.get(p, p))
    body = _NarrowInt64(mod, params).visit_expr(func.body)
    mod["main"] = relax.Function(new_params, body, func.ret_ty, func.is_pure, func.attrs)
    return relax.transform.Normalize()(mod)


def prepare(mod):
    return narrow_int64(mod)


def relax_passes(target) -> list:
    from ._gpu_generic import relax_passes as gpu_passes
    passes = gpu_passes(target)
    # after legalization + DLight (the kernels exist), before lowering the Relax program
    i = next(i for i, p in enumerate(passes) if "RewriteDataflowReshape" in str(getattr(p, "info", p)))
    return passes[:i] + [tvm.tirx.transform.ForceNarrowIndexToInt32()] + passes[i:]


def export(ex, art_dir: Path, target) -> dict:
    from tvm.support import tar
    ex.export_library(str(Path(art_dir) / "lib.tar"), fcompile=tar.tar)
    return {"library": "lib.tar", "link_with": "tvmjs (emscripten): tvm.contrib.tvmjs.create_tvmjs_wasm"}
