"""Runtime devices, one module each (cpu.py, cuda.py, opencl.py, ...), found from their
files as the compiler finds its target_*.py: a new device is a new file here.

A device module holds:
    NAME           its name: `load_artifact(dir, device=NAME)`, `lorac train --target`
    ORDER          its place in listings (help texts, docs)
    TARGETS        the compiler target families whose artifacts it runs (their
                   manifest says target.device == NAME)
    DLPACK         the DLPack device type of its tensors
    DEFAULT_DTYPE  what `lorac train` computes in there
    unavailable(target) -> str | None
                   why `lorac train --target <target>` cannot run on this machine, in one
                   line, or None; asked before anything is loaded or compiled
    open(art_dir, manifest) -> TVM device
                   make the TVM runtime able to run the artifact there (libraries,
                   kernels, library plans) and return the device, or raise LoracError
optional:
    gemm(ta, tb, a, b, out, accumulate=False)   its GEMM library (runtime/engine/gemm.py)
    memory_free() -> int | None                 bytes a step may use (runtime/limits.py)
    CAPTURES_GRAPHS    the training step may run as captured device graphs (CUDA graphs)
    KEEPS_QUANTIZED    --quantized-base auto keeps a quantized base's blocks here (default False:
                       dequantized on load)
    OFFLOADS           --checkpointing offload: checkpointed inputs may wait in host memory
    ORT_PROVIDERS, ORT_MEMORY
                   `--backend ort`: the execution providers used by default and the
                   onnxruntime device the IO-bound buffers live on (runtime/engine/ort.py)
    LOSS_CHUNK_BYTES  the default --loss-chunk keeps a chunk's fp32 logits within this
Importing a device module imports neither TVM nor any device library.
"""
from __future__ import annotations

import functools
import importlib
import pkgutil

from ..errors import LoracError


@functools.cache
def _modules() -> tuple:
    found = [importlib.import_module(f"{__name__}.{m.name}") for m in pkgutil.iter_modules(__path__)
             if not m.name.startswith("_")]
    return tuple(sorted(found, key=lambda d: d.ORDER))


def names() -> tuple[str, ...]:
    """Every device lorac's runtime knows, in listing order."""
    return tuple(d.NAME for d in _modules())


def targets() -> tuple[str, ...]:
    """Every target `lorac train --target` takes (the devices' TARGETS, in listing order)."""
    return tuple(t for d in _modules() for t in d.TARGETS)


def get(name: str):
    """The device module called `name`."""
    for d in _modules():
        if d.NAME == name:
            return d
    raise LoracError(f"unknown device {name!r}: lorac's runtime knows {', '.join(names())}")


def for_target(target: str):
    """The device that runs artifacts of compiler target family `target`."""
    for d in _modules():
        if target in d.TARGETS:
            return d
    raise LoracError(f"unknown target {target!r}: choose one of {', '.join(targets())}")


def of_dlpack(kind: int):
    """The device whose tensors have DLPack device type `kind`, or None."""
    return next((d for d in _modules() if d.DLPACK == kind), None)


def check_trainable(target: str) -> None:
    """One LoracError line when `lorac train --target <target>` cannot run here."""
    why = for_target(target).unavailable(target)
    if why:
        raise LoracError(f"--target {target}: {why}; `lorac train --compile-only` builds the artifacts here for a "
                         "machine that runs them, `--backend ort` runs the graphs on onnxruntime instead")
