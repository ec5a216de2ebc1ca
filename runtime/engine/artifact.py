"""load_artifact: run a compiled lorac artifact with TVM's runtime alone.

    step = load_artifact("art/", device="cpu")     # or "cuda" (runtime/devices/)
    out = step({"input_ids": ids, "labels": labels, "model.embed_tokens.weight": w, ...})
    out["loss"], out["base_model.model....lora_A.weight.grad"]

Needs only `tvm` importable in runtime-only mode (no libtvm_compiler, no torch): the
library is loaded with tvm.runtime.load_module and driven by the Relax VM. The GEMMs the
compiler left as calls are registered here (runtime/engine/gemm.py); the device's module
(runtime/devices/) readies the TVM runtime for the artifact. Inputs and outputs use
the ONNX graph's names (the frontend renamed dotted names; the manifest maps them back).
Every mismatch between the artifact and the call raises one LoracError naming it, and an
artifact whose files do not match its sealed manifest is never loaded (core/artifact_cache.py).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from .. import devices
from lorac.core.artifact_cache import load_library_bytes, load_manifest, read_manifest  # noqa: F401 (benches')
from lorac.core.manifest import Manifest
from lorac.core.dtypes import as_dtype as _np_dtype
from ..errors import LoracError


class Step:
    """One compiled training step: call with a dict of inputs, get a dict of outputs."""

    def __init__(self, vm, manifest: Manifest, dev, device: str, feed=None):
        self.manifest = manifest
        self.inputs = manifest.inputs
        self.outputs = manifest.outputs
        self.device = device
        self._vm = vm
        self._dev = dev
        self._specs = {i["name"]: i for i in self.inputs}
        self._names = set(self._specs)
        # TVM's embedding gather reads out of bounds (and may segfault) on a bad id, so
        # ids and labels are range-checked here, where it is cheap
        self._vocab = next((i["shape"][0] for i in self.inputs if i["name"].endswith("embed_tokens.weight")), None)
        # CUDA-graph builds replay the input addresses they captured on the first call
        # (compiler/targets/cuda binds_inputs): such a step owns one device buffer per input
        # and copies each call's values in, unless the value already is that buffer (what
        # `upload` returns, so weights uploaded once are never copied again)
        self.bound_inputs = manifest.bound_inputs
        self._buffers: dict = {}
        self._captured = False
        # the device's own use of each call's inputs before the artifact runs (devices' feeder:
        # CUDA's packed attention reads the documents of position_ids from its own buffers)
        self._feed = feed

    def _check(self, inputs: dict) -> None:
        missing = [n for n in (i["name"] for i in self.inputs) if n not in inputs]
        if missing:
            more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
            raise LoracError(f"missing artifact input(s): {', '.join(missing[:3])}{more}")
        unknown = sorted(set(inputs) - self._names)
        if unknown:
            raise LoracError(f"unknown input(s) for this artifact: {', '.join(unknown[:3])}")

    def _to_device(self, spec: dict, value):
        if self.bound_inputs and self._buffers.get(spec["name"]) is value:
            return value  # the step's own buffer (uploaded weights, pushed LoRA tensors): checked when filled
        t = self.checked(spec, value)
        if not self.bound_inputs:
            return self._new_tensor(t) if isinstance(t, np.ndarray) else t
        buf = self._buffers.get(spec["name"])
        if buf is None:
            import tvm
            buf = self._buffers[spec["name"]] = tvm.runtime.empty(tuple(spec["shape"]), spec["dtype"], self._dev)
        if isinstance(t, np.ndarray):
            buf.copyfrom(t)
        elif not _same_memory(t, buf):
            t.copyto(buf)
        return buf

    def _new_tensor(self, arr: np.ndarray):
        import tvm
        return tvm.runtime.tensor(arr, self._dev)

    def checked(self, spec: dict, value):
        """`value` checked against input `spec`: a C-contiguous numpy array of its dtype, or a
        device tensor of its shape and dtype on the step's device."""
        import tvm

        want_shape, want_dtype = tuple(spec["shape"]), spec["dtype"]
        if isinstance(value, np.ndarray) or np.isscalar(value):
            arr = np.asarray(value)
            cols = spec.get("columns")  # a weight held joined with LoRA B columns: zeros beside it
            if cols is not None and tuple(arr.shape) == want_shape[:-1] + (cols,):
                arr = np.concatenate([arr, np.zeros(want_shape[:-1] + (want_shape[-1] - cols,), arr.dtype)], axis=-1)
            if tuple(arr.shape) != want_shape:
                raise LoracError(f"input {spec['name']}: shape {list(arr.shape)}, artifact expects {list(want_shape)}")
            if self._vocab and spec["name"] in ("input_ids", "labels") and arr.size:
                lo = -100 if spec["name"] == "labels" else 0  # -100: ignored label
                if arr.max() >= self._vocab or arr.min() < lo or (lo < 0 and ((arr < 0) & (arr != -100)).any()):
                    raise LoracError(f"input {spec['name']}: values outside [0, {self._vocab})")
            if spec["name"] == "position_ids" and arr.size and (arr.min() < 0 or arr.max() >= want_shape[-1]):
                raise LoracError(f"input position_ids: values outside [0, {want_shape[-1]})")
            if arr.dtype != _np_dtype(want_dtype):
                # floats convert (fp32 weights upload as bf16 to a bf16 artifact); ints of
                # another width convert; float <-> int never does, that is a caller bug
                if (arr.dtype.kind == "f" or arr.dtype.name == "bfloat16") != ("float" in want_dtype):
                    raise LoracError(f"input {spec['name']}: dtype {arr.dtype}, artifact expects {want_dtype}")
                arr = arr.astype(_np_dtype(want_dtype))
            # np.ascontiguousarray would turn a 0-d scalar into shape [1]
            return np.require(arr, requirements="C")
        # a device tensor (TVM, or anything speaking DLPack): zero copy, checked as is
        t = value if hasattr(value, "device") and hasattr(value, "shape") and type(value).__module__.startswith("tvm") \
            else tvm.runtime.from_dlpack(value)
        if tuple(t.shape) != want_shape or str(t.dtype) != want_dtype:
            raise LoracError(f"input {spec['name']}: {list(t.shape)} {t.dtype}, artifact expects "
                             f"{list(want_shape)} {want_dtype}")
        if t.device.dlpack_device_type() != self._dev.dlpack_device_type():
            raise LoracError(f"input {spec['name']} is on {t.device}, the artifact runs on {self._dev}")
        return t

    def input_spec(self, name: str) -> dict:
        return self._specs[name]

    def upload_target(self, name: str):
        """The buffer a bound-input step reads input `name` from (after an upload)."""
        return self._buffers[name]

    def upload(self, spec: dict, value):
        """A device tensor for input `spec` (a manifest entry), converted to its dtype; the
        training loop uploads frozen weights once and passes the result to every call. For a
        step with bound inputs it is the step's own buffer for that input: pass it to this
        step only (another upload for the same input overwrites it)."""
        return self._to_device(spec, value)

    def adopt(self, spec: dict, tensor):
        """Input `spec` read from `tensor` (a device tensor of its shape and dtype, e.g. one whose
        memory is pinned host memory: runtime/devices/cuda/mapped.py) as it is: a step with bound
        inputs takes it as its own buffer instead of copying it into one."""
        t = self.checked(spec, tensor)
        if self.bound_inputs:
            self._buffers[spec["name"]] = t
        return t

    def __call__(self, inputs: dict, as_numpy: bool = True) -> dict:
        self._check(inputs)
        args = [self._to_device(spec, inputs[spec["name"]]) for spec in self.inputs]
        feed = getattr(self, "_feed", None)  # a Step built without __init__ (tests) has none
        if feed is not None:
            feed(inputs)
        try:
            res = self._vm["main"](*args)
        except Exception as e:  # TVM raises its own error types
            if _out_of_memory(e):  # past the checks of runtime/limits.py (another process took the memory?)
                raise LoracError(f"out of {self.device} memory while running the artifact ({_last_line(e)}); lower "
                                 "--batch or --seq, or free memory") from None
            if not self.bound_inputs or self._captured:
                raise
            # the first call of a CUDA-graph build is the one that captures its graphs
            raise LoracError(f"the first call of this CUDA-graph artifact (which captures its graphs) failed: "
                             f"{str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__}; "
                             "`lorac train --no-cuda-graph` runs the step without graphs") from None
        self._captured = True
        res = list(res) if len(self.outputs) > 1 else [res]
        if as_numpy:
            res = [r.numpy() for r in res]
        return {o["name"]: r for o, r in zip(self.outputs, res)}


def _out_of_memory(e: Exception) -> bool:
    text = str(e)
    return isinstance(e, MemoryError) or any(s in text for s in (
        "bad_alloc", "out of memory", "OUT_OF_MEMORY", "cudaErrorMemoryAllocation", "Cannot allocate memory"))


def _last_line(e: Exception) -> str:
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else type(e).__name__


def _same_memory(a, b) -> bool:
    return a.data_ptr() == b.data_ptr() and a.device.dlpack_device_type() == b.device.dlpack_device_type()


def load_artifact(art_dir, device: str = "cpu") -> Step:
    """Load a compiled artifact for `device` (a runtime device: devices.names()); see the module doc."""
    dev_module = devices.get(device)
    art_dir = Path(art_dir)
    # an artifact is code: every file is checked against the sealed manifest before any of it
    # runs, and the library is loaded from the very bytes that were checked (core/artifact_cache.py)
    m, lib_bytes = load_manifest(art_dir)
    if m.target.device != device:
        raise LoracError(f"{art_dir} was compiled for target {m.target.family} "
                         f"(runs on {m.target.device}), not for device {device}")

    import tvm
    from tvm.runtime import vm as tvm_vm

    from . import gemm
    gemm.register()
    gemm.register_accumulating(m.accumulating)
    dev = dev_module.open(art_dir, m)
    lib = load_library_bytes(lib_bytes, tvm.runtime.load_module)
    vm = tvm_vm.VirtualMachine(lib, dev)
    return Step(vm, m, dev, device, feed=dev_module.feeder(m))
