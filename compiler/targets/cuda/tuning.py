"""Tuning on the CUDA target (tune.py): MetaSchedule's CUDA rules, candidates timed on this
machine's GPU against the schedule the build would give them (lorac's rules, then DLight:
gpu_generic.default_schedules).

A candidate is built as the artifact's kernels are: TVM writes CUDA source, nvcc turns it
into a fatbin (target_cuda.compile_fatbin), and lorac's load callback, the one the runtime's
loader uses too, hands that to the driver (core/cuda_kernels.py). The candidates of one
round are compiled by parallel nvcc processes, one per core; a source that reaches the
callback without a fatbin (TVM asks for it while building) is compiled there and then. Needs the full TVM (the compiler
library), nvcc and the GPU on one machine; a compile that finds every kernel in the
database needs none of them but the compiler."""
from __future__ import annotations

import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ... import tune as _tune

# what MetaSchedule's CUDA rules and VerifyGPUCode read from the target (sm_90 values; 48 KiB:
# the shared memory a block gets without opting in)
_LIMITS = {"max_threads_per_block": 1024, "max_shared_memory_per_block": 49152, "registers_per_block": 65536}


def tuning_target(target):
    import tvm
    spec = target.export()
    return tvm.target.Target({**spec, **{k: v for k, v in _LIMITS.items() if k not in spec}})


def _default_schedule(mod, target):
    from .._gpu_generic import default_schedules
    from .schedule import first_rules

    with target:
        return default_schedules(first_rules())(mod)


def _device():
    import tvm
    try:
        dev = tvm.cuda(0)
        return dev if dev.exist else None
    except Exception:  # noqa: BLE001 - no CUDA runtime or driver: no device
        return None


def _arch(target) -> str:
    from .fatbin import DEFAULT_ARCH
    return str(target.attrs.get("arch", DEFAULT_ARCH))


def _fatbin(source: str, arch: str) -> bytes:
    from .fatbin import compile_fatbin
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "k.fatbin"
        compile_fatbin(source, arch, out)
        return out.read_bytes()


def _load(mods, target) -> list:
    """Build each candidate, then nvcc all their sources at once; a failure is that
    candidate's result."""
    import tvm

    from lorac.core import cuda_kernels

    from .fatbin import cuda_sources

    arch = _arch(target)
    cuda_kernels.add({}, compile_missing=lambda src: _fatbin(src, arch))
    out, sources = [], {}
    for m in mods:
        lib = _tune.attempt(tvm.tirx.build, m, target)
        out.append(lib)
        for src in [] if isinstance(lib, Exception) else cuda_sources(lib):
            sources.setdefault(cuda_kernels.source_key(src), src)
    todo = {k: s for k, s in sources.items() if not cuda_kernels.has(k)}
    with ThreadPoolExecutor(max(1, min(len(todo), os.cpu_count() or 1))) as pool:
        done = dict(zip(todo, pool.map(lambda s: _tune.attempt(_fatbin, s, arch), todo.values())))
    cuda_kernels.add({k: v for k, v in done.items() if isinstance(v, bytes)})
    failed = {k: v for k, v in done.items() if not isinstance(v, bytes)}
    if failed:  # the candidates whose source nvcc refused
        out = [next((failed[cuda_kernels.source_key(s)] for s in cuda_sources(lib)
                     if cuda_kernels.source_key(s) in failed), lib) if not isinstance(lib, Exception) else lib
               for lib in out]
    return out


TUNER = _tune.Tuner(name="cuda", rules="cuda", tuning_target=tuning_target,
                    default_schedule=_default_schedule, device=_device, load=_load)
DATABASE = TUNER.database
