"""compile_graph: ONNX training graph -> TVM Relax -> passes -> build -> artifact directory.

    import   from_onnx(keep_params_in_input=False): lorac's weights are graph *inputs*, so
             they stay runtime inputs; the only initializers are shape constants, which
             must fold (kept as inputs they make every Reshape symbolic: NOTES.md).
    prepare  the target's own Relax rewrites (WebGPU: 64-bit ints to 32-bit).
    dtype    bfloat16: frozen weights become bf16 inputs (precision.py).
    gemm     every matmul -> a runtime-registered vendor GEMM (gemm.py), on targets
             that have a library; the others keep TVM's kernels. Sums of GEMMs accumulate
             in one call (gemm_sum.py); in bf16, activations leave the GEMMs in bf16
             (gemm_output.py).
    build    the target module's Relax passes (legalize, fuse, schedule, lower) and
             tvm.compile, then the target's export writes the library into the artifact.

The target modules (targets/<family>) share one small interface: FAMILY, DEVICE,
GEMM_LIBRARY, DTYPES, tvm_target(request), check_environment(request), prepare(mod),
relax_passes(target), export(executable, art_dir, target) -> manifest fields; optional:
pass_config(request), binds_inputs(request) (CUDA graphs: targets/cuda), tune(...) (cpu),
native_units(dtype) (the lorac units it maps whole: units.py; the rest are inlined),
ACCUMULATING_GEMMS (sums of GEMMs as one accumulating call: gemm_sum.py; cuda),
ARENA_PLAN (the planned tensors in one arena: memory_plan.py; cpu, aarch64, cuda),
export_units(unit_calls, art_dir, target) -> manifest fields (the target's own kernels for the
graph's native units, written beside the library: cuda's packed attention).
"""
from __future__ import annotations

import importlib
import pkgutil
import json
import os
import signal
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import onnx

from lorac.core import atomic
from lorac.core.constants import TARGET_ORDER
from lorac.core.dtypes import COMPUTE_DTYPES
from lorac.core.errors import LoracError
from lorac.graphs.builder import DOMAIN

from . import manifest as mf
from .units import anchor_outputs, frontend_with, split_units



def _families() -> tuple[str, ...]:
    """The target families, one module or package per family in targets/ (found by name, so
    listing them imports no target module and no TVM; names starting with "_" are shared
    helpers), in lorac's listing order (core/constants.py)."""
    found = {m.name for m in pkgutil.iter_modules([str(Path(__file__).parent / "targets")]) if not m.name.startswith("_")}
    return tuple(sorted(found, key=lambda f: (TARGET_ORDER.index(f) if f in TARGET_ORDER else len(TARGET_ORDER), f)))


FAMILIES = _families()
_LLVM_FAMILIES = ("cpu", "aarch64")  # TVM kind "llvm"; every other family is its own TVM kind
DTYPES = COMPUTE_DTYPES
_ISOLATED = "LORAC_ISOLATED_BUILD"  # set in the child process of an isolated build


def resolve_target(target) -> tuple[str, dict]:
    """(family, request dict) for "cpu" | "cuda" | ... or a TVM target dict {"kind": ...}."""
    if isinstance(target, str):
        if target not in FAMILIES:
            raise LoracError(f"unknown target {target!r}: choose one of {', '.join(FAMILIES)} or pass a TVM target dict")
        return target, {"kind": target}
    if isinstance(target, dict) and "kind" in target:
        kind = target["kind"]
        if kind in FAMILIES and kind not in _LLVM_FAMILIES:
            return kind, dict(target)
        if kind == "llvm":
            triple = str(target.get("mtriple", ""))
            return ("aarch64" if triple.startswith("aarch64") else "cpu"), dict(target)
        raise LoracError(f"unsupported TVM target kind {kind!r}: lorac compiles for {', '.join(FAMILIES)}")
    raise LoracError(f"target must be a name ({', '.join(FAMILIES)}) or a dict with 'kind', got {target!r}")


def target_module(family: str):
    return importlib.import_module(f"lorac.compiler.targets.{family}")


def _load_onnx(model) -> tuple[onnx.ModelProto, str]:
    if isinstance(model, onnx.ModelProto):
        return model, mf.sha256_bytes(model.SerializeToString())
    path = Path(model)
    if not path.is_file():
        raise LoracError(f"ONNX graph not found: {path}")
    data = path.read_bytes()
    try:
        proto = onnx.load_from_string(data)
    except Exception as e:  # protobuf raises its own DecodeError type
        raise LoracError(f"{path} is not an ONNX model: {e}") from None
    if any(t.data_location == onnx.TensorProto.EXTERNAL for t in proto.graph.initializer):
        proto = onnx.load(str(path))  # only shape constants expected, but be correct anyway
    return proto, mf.sha256_bytes(data)


def check_supported_ops(model: onnx.ModelProto, mapped: tuple = ()) -> None:
    """Reject up front, naming every op, what TVM's ONNX frontend cannot convert (`mapped`:
    the lorac units this build converts itself, compiler/units/__init__.py)."""
    from tvm.relax.frontend.onnx import onnx_frontend

    known = set(onnx_frontend._get_convert_map()) | set(mapped)
    bad_domain = sorted({n.domain for n in model.graph.node
                         if n.domain not in ("", "ai.onnx") and not (n.domain == DOMAIN and n.op_type in mapped)})
    if bad_domain:
        raise LoracError(f"graph uses ONNX domains {bad_domain}; TVM reads only the default domain")
    missing = sorted({n.op_type for n in model.graph.node} - known)
    if missing:
        raise LoracError(f"TVM 0.27's ONNX frontend cannot convert these ops: {', '.join(missing)}")


def _signature(model: onnx.ModelProto, func, joined: dict | None = None) -> tuple[list[dict], list[dict]]:
    """Manifest inputs/outputs: ONNX names with the Relax function's shapes and dtypes. A frozen
    weight the step holds joined with LoRA B columns (`joined`: Relax name -> the weight's own width,
    compiler/passes/gemm_lora_k.py) says its own width as `columns`: the runtime pads it with zeros."""
    from tvm import relax

    inits = {i.name for i in model.graph.initializer}
    onnx_inputs = [i.name for i in model.graph.input if i.name not in inits]
    params = list(func.params)
    if len(params) != len(onnx_inputs):
        raise LoracError(f"frontend made {len(params)} parameters for {len(onnx_inputs)} graph inputs")

    def entry(name, ty, **kw):
        return {"name": name, "shape": [int(d) for d in ty.shape.values], "dtype": str(ty.dtype), **kw}

    joined = joined or {}
    inputs = [entry(n, p.ty, relax_name=p.name, **({"columns": joined[p.name]} if p.name in joined else {}))
              for n, p in zip(onnx_inputs, params)]
    ret = func.ret_ty
    rets = list(ret.fields) if isinstance(ret, relax.TupleType) else [ret]
    names = [o.name for o in model.graph.output]
    if len(rets) != len(names):
        raise LoracError(f"compiled function returns {len(rets)} values for {len(names)} graph outputs")
    return inputs, [entry(n, t) for n, t in zip(names, rets)]


def import_onnx(proto: onnx.ModelProto, tmod, dtype: str):
    """TVM's ONNX frontend over `proto` for target module `tmod`: the lorac units the target
    maps stay whole (converted by its converters), the others are inlined (units.py).
    -> (Relax module, names of the mapped units, the distinct calls they make: manifest
    `unit_calls`)."""
    import warnings

    from tvm.relax.frontend.onnx import from_onnx

    from .frontend_ops import frontend_ops

    native = tmod.native_units(dtype) if hasattr(tmod, "native_units") else {}
    proto, units = split_units(proto, native)
    check_supported_ops(proto, tuple(units))
    anchored = anchor_outputs(onnx.ModelProto.FromString(proto.SerializeToString()))
    with warnings.catch_warnings(), frontend_with({**frontend_ops(), **{u: native[u] for u in units}}):
        warnings.simplefilter("ignore")  # one "Renaming name" warning per dotted input
        mod = from_onnx(anchored, keep_params_in_input=False)
    calls = {json.dumps(c, sort_keys=True): c for u in units for c in getattr(native[u], "unit_calls", [])}
    return mod, units, list(calls.values())


def lower_to_relax(proto: onnx.ModelProto, tmod, dtype: str):
    """The Relax module a target builds, before its own passes: import (units.py), the
    byte-indexed lookups' negative-index wraps dropped (lookups.py), the target's prepare,
    bf16 weights (precision.py), GEMM dispatch (gemm.py), accumulating sums (gemm_sum.py),
    bf16 GEMM outputs (gemm_output.py), the bf16 residual stream (residual_stream.py) and wide LoRA
    projections over dequantized weights as one GEMM (gemm_lora_k.py).
    -> (module, mapped units, their calls, the manifest's `gemm` record)."""
    from .passes.lookups import unwrap_unsigned_indices
    mod, units, unit_calls = import_onnx(proto, tmod, dtype)
    mod = tmod.prepare(unwrap_unsigned_indices(mod))
    if dtype == "bfloat16":
        from .passes.precision import frozen_weights_to_bf16
        mod = frozen_weights_to_bf16(mod)
    gemm = {"dispatched": 0, "left_to_tvm": []}
    if tmod.GEMM_LIBRARY:
        from .passes.gemm import dispatch_gemms
        from .passes.gemm_sum import fuse_gemm_sums
        mod, n, left = dispatch_gemms(mod, "bfloat16" if dtype == "bfloat16" else "float32")
        mod, acc = fuse_gemm_sums(mod) if getattr(tmod, "ACCUMULATING_GEMMS", False) else (mod, [])
        gemm = {"dispatched": n, "left_to_tvm": left, "accumulating": acc}
        if dtype == "bfloat16":
            from .passes.gemm_output import narrow_gemm_outputs
            from .passes.residual_stream import RESIDUAL_KEY, narrow_residuals
            mod, gemm["bf16_outputs"] = narrow_gemm_outputs(mod)
            if {p.key: p.value for p in proto.metadata_props}.get(RESIDUAL_KEY) != "float32":
                mod, gemm["bf16_residuals"], gemm["bf16_gradient_sums"], gemm["bf16_read_narrow"] = \
                    narrow_residuals(mod)
            if acc:
                from .passes.gemm_lora_du import lora_du_columns
                from .passes.gemm_lora_k import concat_lora_gemms
                mod, gemm["lora_k_concat"], slots = concat_lora_gemms(mod)
                gemm["lora_k_resident"] = {name: own[0] for name, own in slots.items()}
                mod, gemm["lora_du_columns"], more = lora_du_columns(mod, slots)
                gemm["accumulating"] = sorted(set(acc) | set(more))
    return mod, units, unit_calls, gemm


def bind_all_inputs(mod):
    """Mark every parameter of `main` static for RewriteCUDAGraph (Relax attribute num_input
    = 0: no parameter changes between calls), so CUDA graphs may capture work that reads
    them; the runtime then keeps the inputs at fixed addresses (compiler/targets/cuda binds_inputs)."""
    mod["main"] = mod["main"].with_attr("num_input", 0)
    return mod


def build_passes(passes: list, plan: dict | None = None, arena: bool = False) -> list:
    """A target's Relax `passes` as lorac builds with them: CachedLegalize before
    LegalizeOps (compiler/passes/legalize_cache.py), with `arena` the arena plan after StaticPlanBlockMemory
    (memory_plan.py), and, given a `plan` dict, a read-only pass after
    StaticPlanBlockMemory that writes into it the bytes of device storage the static memory
    plan allocates (all planned tensors, shared by lifetime) and the number of tensors left
    to the runtime's allocator (shapes it could not plan, ops that allocate their own
    outputs): what a step needs beyond its inputs. --tune extracts its kernels with the
    same list, so tuned records match the build's kernels."""
    import tvm
    from tvm import relax

    from .passes.legalize_cache import CachedLegalize
    from .memory_plan import ArenaPlan

    @tvm.transform.module_pass(opt_level=0, name="LoracRecordMemoryPlan")
    def record(mod, _ctx):
        stats = {"static_plan_bytes": 0, "runtime_allocations": 0}

        def visit(e):
            if isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.Op):
                if e.op.name == "relax.memory.alloc_storage":
                    stats["static_plan_bytes"] += int(e.args[0].values[0])
                elif e.op.name == "relax.builtin.alloc_tensor":
                    stats["runtime_allocations"] += 1

        relax.analysis.post_order_visit(mod["main"], visit)
        plan.update(stats)
        return mod

    out = []
    for p in passes:
        if p.info.name == "LegalizeOps":
            out.append(CachedLegalize)
        out.append(p)
        if p.info.name == "StaticPlanBlockMemory":
            if arena:
                out.append(ArenaPlan)
            if plan is not None:
                out.append(record)
    return out


def compile_graph(model, target="cpu", out_dir=None, dtype: str = "float32", tune: int = 0,
                  force: bool = False, verbose: bool = False) -> Path:
    """Compile an ONNX training graph (path or ModelProto) into an artifact directory.

    Returns the directory. When it already holds an artifact of the same key (the graph's
    hash, target, dtype, tune and versions: manifest.cache_key), nothing is rebuilt (unless
    force=True). The build itself is _build (import, passes, tvm.compile), then _publish
    (export into a staging directory, manifest, swap into place).
    """
    family, request = resolve_target(target)
    tmod = _target_for(family, dtype)
    proto, sha = _load_onnx(model)
    art_dir = Path(out_dir) if out_dir is not None else Path("artifacts") / f"{sha[:12]}-{family}-{dtype}"
    key = mf.cache_key(mf.BuildRequest(sha, request, dtype, int(tune)))
    if not force and mf.matches(mf.read(art_dir), key, art_dir):
        return art_dir
    tmod.check_environment(request)
    _check_space(art_dir)
    if getattr(tmod, "ISOLATE_BUILD", False) and not os.environ.get(_ISOLATED):
        return _build_in_child(proto, request, art_dir, dtype, family)
    built = _build(proto, tmod, request, dtype, tune, art_dir)
    manifest = _publish(built, key, family, request, tmod, art_dir)
    if verbose:
        gemm = manifest.gemm
        print(f"lorac compile: {family} {dtype}: {gemm['dispatched']} GEMMs to the vendor library, "
              f"{len(gemm['left_to_tvm'])} left to TVM; {manifest.compile_seconds} s -> {art_dir}")
    return art_dir


MIN_FREE = 16 << 20  # bytes free needed where an artifact goes and in the temporary directory (its object files)


def _check_space(art_dir: Path) -> None:
    """Refuse a build up front where the disk is (nearly) full: LLVM aborts the whole process when
    it cannot write an object file, and the linker's own complaint reached users as an empty
    `Compilation error:`. (A build that still runs out of space is caught in _publish.)"""
    for folder in (Path(art_dir).parent, Path(tempfile.gettempdir())):
        try:
            folder.mkdir(parents=True, exist_ok=True)
            st = os.statvfs(folder)
        except (OSError, AttributeError):  # no statvfs (Windows): the write itself will tell
            continue
        free = st.f_bavail * st.f_frsize
        if free < MIN_FREE:
            raise LoracError(f"cannot write the compiled artifact {art_dir}: no space left on device "
                             f"({free / 2**20:.1f} MiB free in {folder}, {MIN_FREE >> 20} MiB needed at least); free "
                             "space there or build elsewhere (--cache-dir, or lorac compile --out)")


def _target_for(family: str, dtype: str):
    """The target module of `family`, once `dtype` is known to be one it builds."""
    if dtype not in DTYPES:
        raise LoracError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    tmod = target_module(family)
    if dtype not in tmod.DTYPES:
        raise LoracError(f"target {family} supports dtype {', '.join(tmod.DTYPES)}, not {dtype}")
    return tmod


@dataclass
class _Built:
    """A compiled module and what the manifest says about it."""
    executable: object  # tvm.relax.VMExecutable
    tvm_target: object
    inputs: list
    outputs: list
    units: dict
    unit_calls: list
    gemm: dict
    bound: bool
    plan: dict
    seconds: dict = field(default_factory=dict)


def _build(proto, tmod, request: dict, dtype: str, tune: int, art_dir: Path) -> _Built:
    """ONNX -> Relax (lower_to_relax) -> tuning (cpu) -> the target's passes -> tvm.compile."""
    t0 = time.perf_counter()
    mod, units, unit_calls, gemm = lower_to_relax(proto, tmod, dtype)
    inputs, outputs = _signature(proto, mod["main"], gemm.get("lora_k_resident", {}))
    bound = bool(getattr(tmod, "binds_inputs", lambda _r: False)(request))
    if bound:
        mod = bind_all_inputs(mod)
    t_import = time.perf_counter() - t0

    tvm_target = tmod.tvm_target(request)
    if tune:
        if not hasattr(tmod, "tune"):
            raise LoracError(f"--tune is not available for target {tmod.FAMILY}")
        mod = tmod.tune(mod, tvm_target, tune, cache_dir=Path(art_dir).parent / ".lorac-tuning")
    import tvm

    plan: dict = {}
    seq = tvm.transform.Sequential(build_passes(tmod.relax_passes(tvm_target), plan,
                                                arena=getattr(tmod, "ARENA_PLAN", False)))

    @tvm.transform.module_pass(opt_level=0, name="LoracRelaxPipeline")
    def pipeline(m, _ctx):
        with tvm_target:
            return seq(m)

    # no argument checks inside the kernels: only the VM calls them, with its own tensors,
    # and the runtime checks every step input against the manifest first (artifact.py).
    # The checks were ~75 % of the generated code; without them LLVM's part of a Qwen3-0.6B
    # compile drops from ~4.1 s to ~1.7 s (docs/BENCHMARKS.md).
    config = {"tirx.disable_assert": True}
    config.update(tmod.pass_config(request) if hasattr(tmod, "pass_config") else {})
    with tvm.transform.PassContext(opt_level=3, config=config):
        ex = tvm.compile(mod, tvm_target, relax_pipeline=pipeline)
    seconds = {"import": round(t_import, 3), "build": round(time.perf_counter() - t0 - t_import, 3)}
    return _Built(ex, tvm_target, inputs, outputs, units, unit_calls, gemm, bound, plan, seconds)


def _publish(b: _Built, key: dict, family: str, request: dict, tmod, art_dir: Path) -> dict:
    """Export `b` into a fresh staging directory, write its sealed manifest, swap it into place:
    a failed export leaves no half artifact, and two builders of one directory never write
    into each other's files. Returns the manifest."""
    t0 = time.perf_counter()
    stage = mf.staging_dir(art_dir)
    try:
        return _write_artifact(b, key, family, request, tmod, art_dir, stage, t0)
    except Exception as e:  # the disk is full (the linker says so only in its output), or a tool failed
        shutil.rmtree(stage, ignore_errors=True)
        full = atomic.no_space(e, art_dir.parent, tempfile.gettempdir())
        if full:
            raise LoracError(f"cannot write the compiled artifact {art_dir}: {full}; free space there or build "
                             "elsewhere (--cache-dir, or lorac compile --out)") from None
        raise


def _write_artifact(b: _Built, key: dict, family: str, request: dict, tmod, art_dir: Path, stage: Path,
                    t0: float) -> dict:
    files = tmod.export(b.executable, stage, b.tvm_target)
    if hasattr(tmod, "export_units"):  # the target's own kernels for the graph's units (CUDA: packed attention)
        files.update(tmod.export_units(b.unit_calls, stage, b.tvm_target))
    request_fields = {k for k in mf.BuildRequest.__dataclass_fields__}
    manifest = mf.Manifest(
        graph_sha256=key["graph_sha256"], dtype=key["dtype"], tune=key["tune"],
        built_by={k: v for k, v in key.items() if k not in request_fields},
        target=mf.Target(family, request, tmod.DEVICE, _target_json(b.tvm_target)),
        library=files.pop("library"), inputs=b.inputs, outputs=b.outputs, gemm=b.gemm, units=b.units,
        bound_inputs=b.bound, unit_calls=b.unit_calls, memory=b.plan, extra=files,
        compile_seconds={**b.seconds, "export": round(time.perf_counter() - t0, 3)})
    mf.write(stage, manifest)  # with the sha256 of every file, sealed (core/artifact_cache.py)
    mf.publish(stage, art_dir)
    return manifest


def _build_in_child(proto, request: dict, art_dir: Path, dtype: str, family: str) -> Path:
    """Build in a child process, for targets whose TVM codegen can crash the process."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "graph.onnx"
        onnx.save(proto, str(path))
        # SIG_DFL: TVM's own SIGSEGV handler symbolizes a backtrace of its 250 MB library
        # for ~40 s before the process dies; the default action ends it at once
        code = ("import json, signal, sys, tvm; signal.signal(signal.SIGSEGV, signal.SIG_DFL); "
                "from lorac.compiler import compile_graph; "
                "compile_graph(sys.argv[1], target=json.loads(sys.argv[2]), out_dir=sys.argv[3], dtype=sys.argv[4], force=True)")
        r = subprocess.run([sys.executable, "-c", code, str(path), json.dumps(request), str(art_dir), dtype],
                           env={**os.environ, _ISOLATED: "1"}, capture_output=True, text=True)
    if r.returncode == 0:
        return art_dir
    if r.returncode < 0:
        how = f"crashed with {signal.Signals(-r.returncode).name}"
    else:
        lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
        how = f"failed: {lines[-1] if lines else 'exit status ' + str(r.returncode)}"
        if "Segfault" in r.stderr or "Segmentation" in r.stderr or r.returncode == 139:
            how = "crashed with SIGSEGV"
    raise LoracError(f"target {family}: TVM {mf.tvm_version()}'s build {how} (isolated in a child process); "
                     f"this TVM cannot compile for {family}")


def _target_json(target) -> dict:
    """The TVM target as plain JSON (0.27 prints a Target as its JSON config)."""
    import json
    try:
        return json.loads(str(target))
    except json.JSONDecodeError:
        return {"kind": target.kind.name, "repr": str(target)}
