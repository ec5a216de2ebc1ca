"""Tuning on the CPU target (tune.py): LLVM rules, timed on this host's cores against the
parallel default schedule of cpu_schedule."""
from __future__ import annotations

from ... import tune as _tune


def tuning_target(target):
    """The target with the core count, which MetaSchedule's parallel rules need."""
    import tvm
    from tvm.s_tir import meta_schedule as ms

    return tvm.target.Target({**target.export(), "num-cores": ms.utils.cpu_count(logical=False)})


def _default_schedule(mod, target):
    from .schedule import ParallelizeCPU

    with target:  # on a copy: ApplyDefaultSchedule rewrites the module it is given in place
        return ParallelizeCPU(target)(mod)


def _device():
    import tvm
    return tvm.cpu(0)


def _load(mods, target) -> list:
    import tvm
    return [_tune.attempt(tvm.tirx.build, m, target) for m in mods]


TUNER = _tune.Tuner(name="cpu", rules="llvm", tuning_target=tuning_target,
                    default_schedule=_default_schedule, device=_device, load=_load)
DATABASE = TUNER.database
