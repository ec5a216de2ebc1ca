"""`--tune TRIALS` on the CPU target: MetaSchedule for the non-GEMM kernels.

tune() runs the build's passes (pipeline.build_passes of target_cpu.relax_passes) up to
ApplyTuned (legalize, fuse) and takes the fused kernels as MetaSchedule tasks. The heaviest ones (argument bytes x uses) get a share of the
trials each; the best candidate of a task is then timed again next to the default schedule
cpu_schedule would give it, and kept only when it is clearly faster. Every task measured,
kept or not, goes into a JSON database under cache_dir, keyed by the task's structural
hash, so compiling the same graph again measures nothing. The module comes back with the
database's path as an attribute; ApplyTuned, in relax_passes before ParallelizeCPU, gives
the kernels with a kept record their tuned schedule, and ParallelizeCPU the others.

TVM 0.27.0.post1 segfaults serializing any TIR expression (ffi.ToJSONGraph). MetaSchedule's
JSON database (its workloads), LocalBuilder (pickles the module for its workers), the
replay-trace search, and the MutateParallel/MutateComputeLocation mutators the evolutionary
search uses all do. Hence our own JSON file (a record's trace serializes fine), building
and timing in this process, and the replay-func search (random samples of the design
space; needs no mutators, nor a cost model, which would need xgboost).
"""
from __future__ import annotations

import json
import logging
import math
import os
import tempfile
from pathlib import Path

import tvm
import tvm_ffi
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms

from lorac.core.errors import LoracError

DATABASE = "cpu-tuning.json"
_ATTR = "lorac_tuning_database"  # IRModule attribute: tune() -> ApplyTuned
_MIN_PER_TASK, _MAX_PER_TASK = 8, 64  # trials per task
_MARGIN = 0.05  # a tuned kernel must beat the default by this much to be kept
_PAIRS = 3  # default/tuned timings, interleaved, before that decision
_EVAL = ms.runner.EvaluatorConfig(number=10, repeat=3, min_repeat_ms=20)
log = logging.getLogger(__name__)


def tuning_target(target):
    """The target with the core count, which MetaSchedule's parallel rules need."""
    return tvm.target.Target({**target.export(), "num-cores": ms.utils.cpu_count(logical=False)})


def tune(mod, target, trials: int, cache_dir):
    """Spend up to `trials` measurements on the heaviest kernels not yet in the database.

    Which kernels is a function of the graph and `trials` alone (the heaviest
    trials // per-task of them), so compiling again with the same `trials` finds them all
    in the database and measures nothing.
    """
    if trials < 0:
        raise LoracError(f"--tune takes a number of trials >= 0, got {trials}")
    if trials == 0:
        return mod
    path = Path(cache_dir) / DATABASE
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise LoracError(f"cannot create the tuning cache {path.parent}: {e.strerror}") from None
    key = _key(target)
    try:
        tasks = _fused_tasks(mod, target)
    except Exception as e:  # noqa: BLE001 - TVM raises its own error types
        raise LoracError(f"MetaSchedule could not extract the kernels to tune: {_last_line(e)}") from None
    per_task = min(trials, _MAX_PER_TASK, max(_MIN_PER_TASK, trials // max(len(tasks), 1)))
    ranked = sorted(tasks, key=lambda t: -_bytes(t) * t.weight)[:trials // per_task]
    known = _read(path).get(key, {})
    todo = [t for t in ranked if _hash(t.dispatched[0]) not in known]
    log.info("tuning %d of %d kernels, %d trials each (%d already in %s)",
             len(todo), len(tasks), per_task, len(ranked) - len(todo), path)
    if todo:
        _write(path, key, _tune_tasks(todo, tuning_target(target), per_task))
    return mod.with_attr(_ATTR, str(path.resolve()))


def ApplyTuned(target):  # noqa: N802 - reads like the pass it returns
    """The kept schedules of the database tune() named in the module; else a no-op."""
    from tvm import relax

    @tvm.transform.module_pass(opt_level=0, name="LoracApplyTuned")
    def apply(mod, _ctx):
        path = mod.attrs.get(_ATTR) if mod.attrs else None
        if path is None:
            return mod
        mod = mod.without_attr(_ATTR)
        with _StoredDatabase(_read(Path(path)).get(_key(target), {})):
            out = relax.transform.MetaScheduleApplyDatabase()(mod)
        n = sum(1 for gv, f in out.functions_items() if _scheduled(f) and not _scheduled(mod[gv]))
        log.info("applied %d tuned kernel schedules from %s", n, path)
        return out

    return apply


def _scheduled(func) -> bool:
    return isinstance(func, tvm.tirx.PrimFunc) and bool(func.attrs and func.attrs.get("tirx.is_scheduled"))


def _key(target) -> str:
    """Database section: records are only valid for one TVM and one target."""
    return f"tvm {tvm.__version__} {tuning_target(target)}"


def _hash(mod) -> str:
    return f"{tvm_ffi.structural_hash(mod) & (2**64 - 1):016x}"


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise LoracError(f"tuning database {path} is unreadable ({e}); delete it to start over") from None


def _write(path: Path, key: str, entries: dict) -> None:
    """Merge into the file, read again first (another compile may have added entries)."""
    data = _read(path)
    data.setdefault(key, {}).update(entries)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        tmp.replace(path)
    except OSError as e:
        raise LoracError(f"cannot write the tuning database {path}: {e.strerror}") from None


def _fused_tasks(mod, target) -> list:
    """The kernels ApplyTuned will see: the build's passes up to it, in its context."""
    from .pipeline import build_passes
    from .target_cpu import relax_passes

    passes = build_passes(relax_passes(target))
    upto = next(i for i, p in enumerate(passes) if p.info.name == "LoracApplyTuned")
    with target, tvm.transform.PassContext(opt_level=3):
        fused = tvm.transform.Sequential(passes[:upto])(mod)
        return ms.relax_integration.extract_tasks(fused, target)


def _bytes(task) -> int:
    infos = ms.arg_info.ArgInfo.from_prim_func(task.dispatched[0]["main"])
    return sum(math.prod(int(d) for d in a.shape) * tvm.DataType(str(a.dtype)).bits // 8 for a in infos)


def _tune_tasks(tasks, target, per_task: int) -> dict:
    """Database entries for `tasks`, each tuned on its own: a task MetaSchedule fails on
    keeps its default schedule. The best candidate is timed again next to the default,
    interleaved, and kept only when _MARGIN faster: the best of several noisy timings is
    biased low, and the box is shared."""
    built: dict = {}
    errors: list[str] = []  # of failed candidates, from _Builder and _Runner
    builder, runner = _Builder(built, errors), _Runner(built, errors)
    entries, failed = {}, 0
    for t in tasks:
        wl = t.dispatched[0]
        entry = entries[_hash(wl)] = {"task": t.task_name, "trials": per_task, "record": None}
        errors.clear()
        try:
            db = ms.database.MemoryDatabase()
            with tempfile.TemporaryDirectory() as work:
                ms.tune_tasks(tasks=[_context(t, target)], task_weights=[1.0], work_dir=work,
                              max_trials_global=per_task, num_trials_per_iter=per_task,
                              builder=builder, runner=runner, database=db, cost_model="random",
                              task_scheduler="round-robin",
                              measure_callbacks=[ms.measure_callback.AddToDatabase(),
                                                 ms.measure_callback.UpdateCostModel()])
            best = db.get_top_k(db.commit_workload(wl), 1)
            if not best or not best[0].run_secs or max(map(float, best[0].run_secs)) >= 1e9:  # 1e10: failed
                failed += 1
                entry["error"] = f"no candidate built and ran ({errors[-1] if errors else 'none made'})"
                continue
            base, tuned = _default_schedule(t, target), db.query_ir_module(wl, target, t.task_name)
            times = _time([base, tuned] * _PAIRS, target, builder, runner)
        except Exception as e:  # noqa: BLE001 - this task keeps its default schedule
            failed += 1
            entry["error"] = _last_line(e)
            continue
        finally:
            built.clear()
        if None in times[1::2]:
            entry["error"] = "the tuned kernel failed when timed again"
            continue
        default_s, tuned_s = min((d for d in times[::2] if d is not None), default=None), min(times[1::2])
        entry.update(default_us=_us(default_s), tuned_us=_us(tuned_s))
        if default_s is None or tuned_s < (1 - _MARGIN) * default_s:
            entry["record"] = json.dumps(best[0].as_json(), separators=(",", ":"))
    if failed == len(tasks):
        raise LoracError(f"MetaSchedule could not tune any kernel: {next(iter(entries.values()))['error']}")
    kept = sum(e["record"] is not None for e in entries.values())
    log.info("tuned %d kernels: %d kept (faster than the default), %d failed", len(tasks), kept, failed)
    return entries


def _context(task, target):
    """A MetaSchedule task: the LLVM schedule rules and postprocessors, no mutators.

    Made through the FFI constructor TuneContext.__init__ calls: __init__ first imports
    tvm.s_tir.tensor_intrin, which registers every tensor intrinsic TVM has (~30 s on the
    2-core box); the LLVM float rules use none."""
    from tvm.s_tir.meta_schedule import _ffi_api
    from tvm.s_tir.meta_schedule.logging import get_logger, get_logging_func

    space = ms.space_generator.PostOrderApply(
        sch_rules=ms.ScheduleRule.create("llvm"), postprocs=ms.Postproc.create("llvm"), mutator_probs={})
    ctx = ms.TuneContext.__new__(ms.TuneContext)
    ctx.__init_handle_by_constructor__(
        _ffi_api.TuneContext, task.dispatched[0], target, space,
        ms.search_strategy.SearchStrategy.create("replay-func"), task.task_name, 1, 0,
        get_logging_func(get_logger(__name__)))
    _ffi_api.TuneContextInitialize(ctx)
    return ctx


def _default_schedule(task, target):
    from .cpu_schedule import ParallelizeCPU

    with target:  # on a copy: ApplyDefaultSchedule rewrites the module it is given in place
        return ParallelizeCPU(target)(tvm.IRModule({"main": task.dispatched[0]["main"]}))


def _time(mods, target, builder, runner) -> list[float | None]:
    """Fastest repeat, in seconds, of each module's "main" (None where build or run failed)."""
    built = builder.build([ms.builder.BuilderInput(m, target) for m in mods])
    inputs = [ms.runner.RunnerInput(b.artifact_path, target.kind.name,
                                    ms.arg_info.ArgInfo.from_prim_func(m["main"]))
              for m, b in zip(mods, built) if b.error_msg is None]
    results = iter([f.result() for f in runner.run(inputs)])
    out = []
    for b in built:
        r = next(results) if b.error_msg is None else None
        out.append(min(float(s) for s in r.run_secs) if r is not None and r.error_msg is None else None)
    return out


def _us(s: float | None) -> float | None:
    return None if s is None else round(s * 1e6, 2)


def _last_line(e: Exception) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return lines[-1] if lines else type(e).__name__


@derived_object
class _Builder(ms.builder.PyBuilder):
    """Builds in this process and keeps the module in memory for _Runner: LocalBuilder
    pickles the module for its workers (segfaults here) and exports a tar to link again.
    What MetaSchedule's default_build does, less its tvm.s_tir.tensor_intrin import."""

    def __init__(self, built: dict, errors: list):
        super().__init__()
        self.built, self.errors = built, errors

    def build(self, build_inputs):
        from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

        out = []
        for b in build_inputs:
            try:
                mod = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(b.mod)
                key = f"in-process:{len(self.built)}"
                self.built[key] = tvm.tirx.build(mod, b.target)
                out.append(ms.builder.BuilderResult(key, None))
            except Exception as e:  # noqa: BLE001 - a failed candidate is a measurement result
                self.errors.append(f"build failed: {_last_line(e)}")
                out.append(ms.builder.BuilderResult(None, self.errors[-1]))
        return out


@derived_object
class _Runner(ms.runner.PyRunner):
    """Times what _Builder built, in this process (LocalRunner's worker pool needs
    cloudpickle), on random floats and all-zero integers, so gathers stay in bounds."""

    def __init__(self, built: dict, errors: list):
        super().__init__()
        self.built, self.errors = built, errors

    def run(self, runner_inputs):
        import numpy as np
        from tvm.s_tir.meta_schedule.runner.local_runner import LocalRunnerFuture
        from tvm.s_tir.meta_schedule.runner.utils import run_evaluator_common

        rng, dev, out = np.random.default_rng(0), tvm.cpu(0), []
        for r in runner_inputs:
            try:
                args = []
                for a in r.args_info:
                    shape, dtype = [int(d) for d in a.shape], str(a.dtype)
                    x = rng.standard_normal(shape).astype(dtype) if "float" in dtype else np.zeros(shape, dtype)
                    args.append(tvm.runtime.tensor(x, dev))
                secs = run_evaluator_common(self.built[r.artifact_path], dev, _EVAL, [args])
                out.append(LocalRunnerFuture(res=secs, error_message=None))
            except Exception as e:  # noqa: BLE001
                self.errors.append(f"run failed: {_last_line(e)}")
                out.append(LocalRunnerFuture(res=None, error_message=self.errors[-1]))
        return out


@derived_object
class _StoredDatabase(ms.database.PyDatabase):
    """One target's kept records, read-only, for MetaScheduleApplyDatabase."""

    def __init__(self, entries: dict):
        super().__init__()
        self.records = {h: e["record"] for h, e in entries.items() if e.get("record")}

    def has_workload(self, mod):
        return _hash(mod) in self.records

    def commit_workload(self, mod):
        return ms.database.Workload(mod)

    def commit_tuning_record(self, record):
        pass

    def get_top_k(self, workload, top_k):
        rec = self.records.get(_hash(workload.mod))
        return [ms.database.TuningRecord.from_json(json.loads(rec), workload)] if rec and top_k > 0 else []

    def get_all_tuning_records(self):
        return []

    def __len__(self):
        return len(self.records)
