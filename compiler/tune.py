"""`--tune TRIALS`: MetaSchedule for the kernels TVM generates (cpu, cuda).

tune() runs the build's passes (pipeline.build_passes of the target's relax_passes) up to
ApplyTuned (legalize, fuse) and takes the fused kernels as MetaSchedule tasks; kernels that
arrive already scheduled (lorac's own TIR units: SwiGLU's backward, AdamW, the scan) are
not tasks. The heaviest ones (argument bytes x calls) get a share of the trials each; the
best candidate of a task is then timed again next to the default schedule the build would
give it, and kept only when it is clearly faster. Every task measured, kept or not, goes
into a JSON database under cache_dir, keyed by the task's structural hash, as soon as it is
done (a run cut short keeps what it measured), so compiling the same graph again measures
nothing. The module comes back with the database's path as an attribute; ApplyTuned, in the
target's relax_passes before its default schedules, gives the kernels with a kept record
their tuned schedule, and the default rules the others.

What differs per target is a `Tuner` (targets/cpu/tuning.py, targets/cuda/tuning.py): MetaSchedule's rule set,
the default schedule a candidate must beat, the device that times candidates and how a
candidate becomes runnable code (CUDA: nvcc, in parallel).

TVM 0.27.0.post1 segfaults serializing any TIR expression (ffi.ToJSONGraph). MetaSchedule's
JSON database (its workloads), LocalBuilder (pickles the module for its workers), the
replay-trace search, and the mutators the evolutionary search uses all do. Hence our own
JSON file (a record's trace serializes fine), building and timing in this process, and the
replay-func search (random samples of the design space; needs no mutators, nor a cost
model, which would need xgboost).
"""
from __future__ import annotations

import json
import logging
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import tvm
import tvm_ffi
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms

from lorac.core.errors import LoracError

_ATTR = "lorac_tuning_database"  # IRModule attribute: tune() -> ApplyTuned
_MIN_PER_TASK, _MAX_PER_TASK = 8, 64  # trials per task
_MARGIN = 0.05  # a tuned kernel must beat the default by this much to be kept
_PAIRS = 3  # default/tuned timings, interleaved, before that decision
_EVAL = ms.runner.EvaluatorConfig(number=10, repeat=3, min_repeat_ms=20)
log = logging.getLogger(__name__)
# MetaSchedule's own messages (each design space and trial, at INFO): warnings and errors only
_ms_log = logging.getLogger(f"{__name__}.metaschedule")
_ms_log.setLevel(logging.WARNING)


@dataclass(frozen=True)
class Tuner:
    """What tuning needs to know of one target."""
    name: str  # the database file is f"{name}-tuning.json"
    rules: str  # MetaSchedule's schedule rules and postprocessors: "llvm", "cuda"
    tuning_target: Callable  # target -> the target with what MetaSchedule's rules read
    default_schedule: Callable  # (IRModule of one kernel, target) -> the build's schedule of it
    device: Callable  # () -> the tvm device candidates run on, or None when there is none
    load: Callable  # (list of scheduled IRModules, target) -> list of runnable modules or exceptions

    @property
    def database(self) -> str:
        return f"{self.name}-tuning.json"


def attempt(fn, *args):
    """fn(*args), or the exception it raised: a candidate that fails to build is a result."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001
        return e


def tune(mod, target, trials: int, cache_dir, tuner: Tuner, relax_passes: Callable):
    """Spend up to `trials` measurements on the heaviest kernels not yet in the database.

    Which kernels is a function of the graph and `trials` alone (the heaviest
    trials // per-task of them), so compiling again with the same `trials` finds them all
    in the database and measures nothing (and needs no device to measure on).
    `relax_passes`: target -> the target's Relax passes (ApplyTuned among them).
    """
    if trials < 0:
        raise LoracError(f"--tune takes a number of trials >= 0, got {trials}")
    if trials == 0:
        return mod
    path = Path(cache_dir) / tuner.database
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise LoracError(f"cannot create the tuning cache {path.parent}: {e.strerror}") from None
    key = _key(target, tuner)
    try:
        tasks = _fused_tasks(mod, target, relax_passes)
    except Exception as e:  # noqa: BLE001 - TVM raises its own error types
        raise LoracError(f"MetaSchedule could not extract the kernels to tune: {_last_line(e)}") from None
    per_task = min(trials, _MAX_PER_TASK, max(_MIN_PER_TASK, trials // max(len(tasks), 1)))
    ranked = sorted(tasks, key=lambda t: -_bytes(t) * t.weight)[:trials // per_task]
    known = _read(path).get(key, {})
    todo = [t for t in ranked if _hash(t.dispatched[0]) not in known]
    log.info("tuning %d of %d kernels, %d trials each (%d already in %s)",
             len(todo), len(tasks), per_task, len(ranked) - len(todo), path)
    if todo:
        if tuner.device() is None:
            raise LoracError(f"tuning {tuner.name} kernels needs the device they run on, and this machine has "
                             f"none: {len(todo)} of the {len(ranked)} kernels to tune are not in {path} (tune on "
                             f"the machine with the device, then copy that file here)")
        _tune_tasks(todo, tuner.tuning_target(target), per_task, tuner, lambda e: _write(path, key, e))
    return mod.with_attr(_ATTR, str(path.resolve()))


def ApplyTuned(target, tuner: Tuner):  # noqa: N802 - reads like the pass it returns
    """The kept schedules of the database tune() named in the module; else a no-op."""
    from tvm import relax

    @tvm.transform.module_pass(opt_level=0, name="LoracApplyTuned")
    def apply(mod, _ctx):
        path = mod.attrs.get(_ATTR) if mod.attrs else None
        if path is None:
            return mod
        mod = mod.without_attr(_ATTR)
        with _StoredDatabase(_read(Path(path)).get(_key(target, tuner), {})):
            out = relax.transform.MetaScheduleApplyDatabase()(mod)
        n = sum(1 for gv, f in out.functions_items() if _scheduled(f) and not _scheduled(mod[gv]))
        log.info("applied %d tuned kernel schedules from %s", n, path)
        return out

    return apply


def _scheduled(func) -> bool:
    return isinstance(func, tvm.tirx.PrimFunc) and bool(func.attrs and func.attrs.get("tirx.is_scheduled"))


def _key(target, tuner: Tuner) -> str:
    """Database section: records are only valid for one TVM and one target."""
    return f"tvm {tvm.__version__} {tuner.tuning_target(target)}"


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


def _fused_tasks(mod, target, relax_passes: Callable) -> list:
    """The kernels ApplyTuned will see (the build's passes up to it, in its context), less
    those that come scheduled."""
    from .pipeline import build_passes

    passes = build_passes(relax_passes(target))
    upto = next(i for i, p in enumerate(passes) if p.info.name == "LoracApplyTuned")
    with target, tvm.transform.PassContext(opt_level=3):
        fused = tvm.transform.Sequential(passes[:upto])(mod)
        tasks = ms.relax_integration.extract_tasks(fused, target)
    return [t for t in tasks if not _scheduled(t.dispatched[0]["main"])]


def _bytes(task) -> int:
    infos = ms.arg_info.ArgInfo.from_prim_func(task.dispatched[0]["main"])
    return sum(math.prod(int(d) for d in a.shape) * tvm.DataType(str(a.dtype)).bits // 8 for a in infos)


def _tune_tasks(tasks, target, per_task: int, tuner: Tuner, save: Callable) -> dict:
    """Database entries for `tasks`, each tuned on its own: a task MetaSchedule fails on
    keeps its default schedule. The best candidate is timed again next to the default,
    interleaved, and kept only when _MARGIN faster: the best of several noisy timings is
    biased low, and the box is shared. Entries go to `save` as tasks finish, from the first
    that tuned on (when every task fails, nothing is saved)."""
    built: dict = {}
    errors: list[str] = []  # of failed candidates, from _Builder and _Runner
    builder, runner = _Builder(built, errors, tuner), _Runner(built, errors, tuner.device())
    inputs = runner.inputs
    entries, failed, pending = {}, 0, {}
    for i, t in enumerate(tasks, 1):
        wl = t.dispatched[0]
        entry = {"task": t.task_name, "calls": int(t.weight), "trials": per_task, "record": None}
        entries[_hash(wl)] = pending[_hash(wl)] = entry
        errors.clear()
        try:
            entry.update(_tune_one(t, wl, target, per_task, builder, runner, errors))
        except Exception as e:  # noqa: BLE001 - this task keeps its default schedule
            failed += 1
            entry["error"] = _last_line(e)
        finally:
            built.clear()
            inputs.clear()
        log.info("kernel %d/%d %s: %s", i, len(tasks), t.task_name, _outcome(entry))
        if failed < i:  # something tuned: keep what is done
            save(pending)
            pending = {}
    if failed == len(tasks):
        raise LoracError(f"MetaSchedule could not tune any kernel: {next(iter(entries.values()))['error']}")
    kept = sum(e["record"] is not None for e in entries.values())
    log.info("tuned %d kernels: %d kept (faster than the default), %d failed", len(tasks), kept, failed)
    return entries


def _tune_one(task, wl, target, per_task: int, builder, runner, errors: list) -> dict:
    db = ms.database.MemoryDatabase()
    with tempfile.TemporaryDirectory() as work:
        ms.tune_tasks(tasks=[_context(task, target, builder.tuner.rules)], task_weights=[1.0], work_dir=work,
                      max_trials_global=per_task, num_trials_per_iter=per_task,
                      builder=builder, runner=runner, database=db, cost_model="random",
                      task_scheduler="round-robin",
                      measure_callbacks=[ms.measure_callback.AddToDatabase(),
                                         ms.measure_callback.UpdateCostModel()])
    best = db.get_top_k(db.commit_workload(wl), 1)
    if not best or not best[0].run_secs or max(map(float, best[0].run_secs)) >= 1e9:  # 1e10: failed
        raise RuntimeError(f"no candidate built and ran ({errors[-1] if errors else 'none made'})")
    base = builder.tuner.default_schedule(tvm.IRModule({"main": wl["main"]}), target)
    default_s, tuned_s = _time_pair(base, db.query_ir_module(wl, target, task.task_name), target, builder, runner)
    if tuned_s is None:
        return {"error": "the tuned kernel failed when timed again"}
    out = {"default_us": _us(default_s), "tuned_us": _us(tuned_s)}
    if default_s is None or tuned_s < (1 - _MARGIN) * default_s:
        out["record"] = json.dumps(best[0].as_json(), separators=(",", ":"))
    return out


def _outcome(entry: dict) -> str:
    if "error" in entry:
        return f"default kept ({entry['error']})"
    verdict = "tuned schedule kept" if entry["record"] else "default kept"
    return f"{entry['default_us']} -> {entry['tuned_us']} us, {verdict}"


def _context(task, target, rules: str):
    """A MetaSchedule task: the target's schedule rules and postprocessors, no mutators.

    Made through the FFI constructor TuneContext.__init__ calls: __init__ first imports
    tvm.s_tir.tensor_intrin, which registers every tensor intrinsic TVM has (~30 s on the
    2-core box); the float rules of llvm and cuda use none."""
    from tvm.s_tir.meta_schedule import _ffi_api
    from tvm.s_tir.meta_schedule.logging import get_logging_func

    space = ms.space_generator.PostOrderApply(
        sch_rules=ms.ScheduleRule.create(rules), postprocs=ms.Postproc.create(rules), mutator_probs={})
    ctx = ms.TuneContext.__new__(ms.TuneContext)
    ctx.__init_handle_by_constructor__(
        _ffi_api.TuneContext, task.dispatched[0], target, space,
        ms.search_strategy.SearchStrategy.create("replay-func"), task.task_name, 1, 0,
        get_logging_func(_ms_log))
    _ffi_api.TuneContextInitialize(ctx)
    return ctx


def _time_pair(base, tuned, target, builder, runner) -> tuple[float | None, float | None]:
    """Fastest repeat, in seconds, of the default and the tuned kernel (None where build or run
    failed): each built once, timed _PAIRS times, interleaved."""
    built = builder.build([ms.builder.BuilderInput(m, target) for m in (base, tuned)])
    ok = [(m, b) for m, b in zip((base, tuned), built) if b.error_msg is None]
    inputs = [ms.runner.RunnerInput(b.artifact_path, target.kind.name, ms.arg_info.ArgInfo.from_prim_func(m["main"]))
              for m, b in ok] * _PAIRS
    results = [f.result() for f in runner.run(inputs)]
    secs: dict = {}
    for (_, b), r in zip(ok * _PAIRS, results):
        if r.error_msg is None:
            secs.setdefault(b.artifact_path, []).append(min(float(s) for s in r.run_secs))
    return tuple(min(secs[b.artifact_path]) if b.error_msg is None and b.artifact_path in secs else None
                 for b in built)


def _us(s: float | None) -> float | None:
    return None if s is None else round(s * 1e6, 2)


def _last_line(e: Exception) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return lines[-1] if lines else type(e).__name__


@derived_object
class _Builder(ms.builder.PyBuilder):
    """Builds in this process and keeps the runnable module in memory for _Runner:
    LocalBuilder pickles the module for its workers (segfaults here) and exports a tar to
    link again. What MetaSchedule's default_build does, less its tvm.s_tir.tensor_intrin
    import; the target's Tuner.load makes the code runnable (CUDA: all candidates' device
    code at once)."""

    def __init__(self, built: dict, errors: list, tuner: Tuner):
        super().__init__()
        self.built, self.errors, self.tuner = built, errors, tuner

    def build(self, build_inputs):
        from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

        mods = [RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(b.mod) for b in build_inputs]
        target = build_inputs[0].target if build_inputs else None
        out = []
        for loaded in (self.tuner.load(mods, target) if mods else []):
            if isinstance(loaded, Exception):  # a failed candidate is a measurement result
                self.errors.append(f"build failed: {_last_line(loaded)}")
                out.append(ms.builder.BuilderResult(None, self.errors[-1]))
                continue
            key = f"in-process:{len(self.built)}"
            self.built[key] = loaded
            out.append(ms.builder.BuilderResult(key, None))
        return out


@derived_object
class _Runner(ms.runner.PyRunner):
    """Times what _Builder built, in this process (LocalRunner's worker pool needs
    cloudpickle), on random floats and all-zero integers, so gathers stay in bounds. The
    arguments of one signature are made and uploaded once (a task's candidates share them:
    a logits chunk is hundreds of MB)."""

    def __init__(self, built: dict, errors: list, device):
        super().__init__()
        self.built, self.errors, self.dev = built, errors, device
        self.inputs: dict = {}  # ((shape, dtype), ...) -> device tensors

    def run(self, runner_inputs):
        import numpy as np
        from tvm.s_tir.meta_schedule.runner.local_runner import LocalRunnerFuture
        from tvm.s_tir.meta_schedule.runner.utils import run_evaluator_common

        rng, out = np.random.default_rng(0), []
        for r in runner_inputs:
            try:
                sig = tuple((tuple(int(d) for d in a.shape), str(a.dtype)) for a in r.args_info)
                if sig not in self.inputs:
                    self.inputs[sig] = [tvm.runtime.tensor(_random(rng, *a), self.dev) for a in sig]
                args = self.inputs[sig]
                secs = run_evaluator_common(self.built[r.artifact_path], self.dev, _EVAL, [args])
                out.append(LocalRunnerFuture(res=secs, error_message=None))
            except Exception as e:  # noqa: BLE001
                self.errors.append(f"run failed: {_last_line(e)}")
                out.append(LocalRunnerFuture(res=None, error_message=self.errors[-1]))
        return out


def _random(rng, shape, dtype: str):
    """Standard normal floats (bf16 through ml_dtypes; one block of 2^20 tiled, so a large
    argument takes no seconds to make), zeros for integers and bools."""
    import ml_dtypes
    import numpy as np

    if "float" not in dtype:
        return np.zeros(shape, dtype)
    block = rng.standard_normal(1 << 20, dtype=np.float32).astype(getattr(ml_dtypes, dtype, dtype))
    return np.resize(block, shape)


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
