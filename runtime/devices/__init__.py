"""Runtime devices, one module (or package) each (cpu/, cuda/, opencl.py, ...), found from
their files as the compiler finds its targets: a new device is a new file here. The run asks
its device (resolved once, `for_target`) what to do instead of branching on a target's name
(tests/test_layers.py forbids such branches outside runtime/devices/ and compiler/targets/).

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
                   make the TVM runtime able to run the artifact (its manifest: a
                   lorac.core.manifest.Manifest) there (libraries,
                   kernels, library plans) and return the device, or raise LoracError
optional (a module without one gets the default in OPTIONAL below):
    gemm(ta, tb, a, b, out, accumulate=False)   its GEMM library (runtime/engine/gemm.py)
    gemm_info() -> str | None       one log line naming that library (cpu: which BLAS)
    memory_free() -> int | None     bytes a step may use: the step's lower bound is checked
                                    against it (runtime/limits.py), --checkpointing auto fits it
    memory_info() -> (free, total) | None
                                    the device's memory now, logged after the first step
    MEMORY_OF      how an error names that memory ("this machine", "the GPU")
    AUTO_CHECKPOINTING
                   `--checkpointing auto` picks the fastest setting whose estimated memory
                   fits (runtime/train/memory.py); elsewhere auto means off
    LOSS_CHUNK_BYTES
                   `--loss-chunk 0`: chunks whose fp32 logits fit this many bytes
                   (graphs/loss.auto_chunk); None: one chunk
    FUSED_ATTENTION
                   attention is one fused kernel (cuDNN SDPA) holding no [S, S] scores,
                   for plain rows and rows packed in isolation alike
    ISOLATED_PACKING_FAST
                   isolated packing runs at plain packing's cost, so `--packing auto`
                   picks it where the model family has it
    reserve_documents(per_row, longest)
                   the most documents a row of the run's data holds and its longest
                   document (--packing isolated), told before any artifact loads (cuda:
                   what its packed attention's plans are sized for)
    feeder(manifest) -> callable(inputs) | None
                   a function the artifact's Step calls with each call's inputs before
                   it runs (cuda: the packed attention's documents from position_ids)
    TUNED_TARGETS  its targets whose kernels `--tune` (MetaSchedule) can measure here
    CAPTURES_GRAPHS
                   the training step may run as captured device graphs (CUDA graphs)
    KEEPS_QUANTIZED
                   --quantized-base auto keeps a quantized base's blocks here (else
                   dequantized on load)
    KEEPS_QUANTIZED_ABOVE
                   where KEEPS_QUANTIZED is False: auto keeps the blocks when the base
                   held dense would take more than this share of memory_free() (None: never)
    OFFLOADS       --checkpointing offload: checkpointed inputs may wait in host memory
    host_pinnable() -> int | None
                   where OFFLOADS: the host bytes offloaded values may pin (None: no limit
                   known); --checkpointing auto passes over settings that would pin more
    host_table(shape, dtype) -> (tensor, numpy view)
                   a device tensor whose memory is pinned host memory the device reads in
                   place, and a numpy array over it to fill (--offload-embeddings); None
                   where the device has no such memory
    DEVICE_PER_WORKER
                   data-parallel workers on one host take one device each (select(i))
    select(index)  make device `index` of this host the one artifacts open on
    GRAD_ALLREDUCE how data-parallel workers sum gradients: "host" (MPI over numpy
                   copies) or "nccl" (on the device, runtime/dist/nccl.py)
    ORT_PROVIDERS, ORT_MEMORY
                   `--backend ort`: the execution providers used by default and the
                   onnxruntime device the IO-bound buffers live on (runtime/engine/ort.py)
    TRAINS_ON      the backend `lorac train` uses there whatever --backend says ("ort":
                   webgpu, through onnxruntime's plugin), or None; such a device is also
                   the target of `--backend ort --ort-providers <its provider>`
    check_ort()    one LoracError line now when `--backend ort` cannot run there (webgpu:
                   the plugin and an adapter)
Importing a device module imports neither TVM nor any device library.
"""
from __future__ import annotations

import functools
import importlib
import pkgutil

from ..errors import LoracError


def _nothing(*_args):
    return None


# the optional part of the interface (module doc) and what a device without it does
OPTIONAL = {
    "gemm_info": _nothing, "memory_free": _nothing, "memory_info": _nothing, "MEMORY_OF": "the device",
    "AUTO_CHECKPOINTING": False, "LOSS_CHUNK_BYTES": None, "FUSED_ATTENTION": False,
    "ISOLATED_PACKING_FAST": True, "TUNED_TARGETS": (), "CAPTURES_GRAPHS": False, "KEEPS_QUANTIZED": False,
    "KEEPS_QUANTIZED_ABOVE": None,
    "OFFLOADS": False, "host_pinnable": _nothing, "host_table": None,
    "DEVICE_PER_WORKER": False, "select": _nothing, "GRAD_ALLREDUCE": "host", "TRAINS_ON": None,
    "check_ort": _nothing, "reserve_documents": _nothing, "feeder": _nothing,
}


@functools.cache
def _modules() -> tuple:
    found = [importlib.import_module(f"{__name__}.{m.name}") for m in pkgutil.iter_modules(__path__)
             if not m.name.startswith("_")]
    for d in found:  # the run asks every device the same questions
        for key, default in OPTIONAL.items():
            if not hasattr(d, key):
                setattr(d, key, default)
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


def named_by_providers(providers: str | None):
    """The device that trains through onnxruntime only (TRAINS_ON "ort") whose own provider
    --ort-providers names ("webgpu", "WebGpuExecutionProvider"), or None."""
    short = lambda p: p.strip().lower().removesuffix("executionprovider")  # noqa: E731
    asked = {short(p) for p in (providers or "").split(",")}
    return next((d for d in _modules() if d.TRAINS_ON == "ort" and short(d.ORT_PROVIDERS[0]) in asked), None)


def tuned_targets() -> tuple[str, ...]:
    """The targets whose kernels `--tune` can measure (the devices' TUNED_TARGETS)."""
    return tuple(t for d in _modules() for t in d.TUNED_TARGETS)


def of_dlpack(kind: int):
    """The device whose tensors have DLPack device type `kind`, or None."""
    return next((d for d in _modules() if d.DLPACK == kind), None)


def check_trainable(target: str) -> None:
    """One LoracError line when `lorac train --target <target>` cannot run here."""
    why = for_target(target).unavailable(target)
    if why:
        raise LoracError(f"--target {target}: {why}; `lorac train --compile-only` builds the artifacts here for a "
                         "machine that runs them, `--backend ort` runs the graphs on onnxruntime instead")
