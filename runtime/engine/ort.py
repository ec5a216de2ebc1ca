"""The onnxruntime backend: the TVM engine's methods (runtime/engine/tvm.py) over the same training, eval,
forward and LoRA+ AdamW graphs (lorac.graphs), run by onnxruntime on any of its execution
providers (CPU, CUDA, TensorRT, ROCm/MIGraphX, DirectML, CoreML, OpenVINO, ...) and on its
WebGPU plugin (ort_webgpu.py: AMD, Apple, Intel and NVIDIA GPUs through Vulkan, Metal or
D3D12). `lorac train --backend ort` is therefore the same loop with the same checkpoints.

    eng = OrtEngine(spec, train, weights, target="cpu", providers="CPUExecutionProvider")
    eng = OrtEngine(spec, train, weights, target="webgpu")   # lorac train --target webgpu

Needs onnxruntime (pip install 'lorac[ort]', or the onnxruntime build for the device;
'lorac[webgpu]' for the plugin); no TVM, no torch. fp32 only (the bf16 mode is a TVM compiler
pass).

Residency, through IO binding: every tensor a step reads or writes but the batch lives on
the device as an OrtValue, bound once and rebound only when it is replaced. The frozen
weights are uploaded at the first graph. The LoRA tensors, AdamW moments and gradients live
in flat per-bucket buffers (graphs/optimizer.Bucket), as in the TVM engine: the training
step takes each bucket's parameters as one flat input and writes its gradients as one flat
output (graphs/flat_lora.py slices the tensors out inside the graph); the optimizer graph
reads those and writes the next parameters and moments into a second set of buffers (an
output bound over an input is not allowed in onnxruntime), which become the current ones
unless the step was skipped. Per step only ids and labels go to the device; the loss, grad
norm and skipped flag come back. Where the buffers live (Values):
- cpu, cuda: memory onnxruntime's Python API addresses (OrtValue.numpy, update_inplace);
- webgpu: the plugin's device memory, opaque buffers (no address, no numpy view): allocated
  from the memory info its device entry declares and copied with onnxruntime.copy_tensors
  through the plugin's data transfer. LORAC_ORT_WEBGPU_HOST=1 keeps them on the host
  instead (onnxruntime then copies every input in and every output out at each run).
LORAC_ORT_EP_OPTIONS="key=value;key=value" passes provider options to the plugin (e.g. the
WebGPU EP's validationMode=disabled; checked against the options it reads: ort_webgpu.options).
"""
from __future__ import annotations

import os
import time
from collections import Counter

import numpy as np

from .. import devices
from . import ort_webgpu
from .graphs import Graphs
from ..errors import LoracError


def _onnxruntime():
    try:
        import onnxruntime
    except ImportError:
        raise LoracError("--backend ort needs onnxruntime: pip install 'lorac[ort]' (or the onnxruntime build "
                         "for your device, such as onnxruntime-gpu; for --target webgpu: pip install "
                         "'lorac[webgpu]')") from None
    return onnxruntime


def resolve_providers(asked, available: list[str], plugins=ort_webgpu.PLUGINS) -> list[str]:
    """Execution providers from --ort-providers ("CUDAExecutionProvider,CPUExecutionProvider",
    or short and in any case: "cuda,cpu", "webgpu"), each one this onnxruntime build has or a
    plugin lorac registers (`plugins`)."""
    names = [n.strip() for n in asked.split(",")] if isinstance(asked, str) else list(asked)
    short = {a.lower().removesuffix("executionprovider"): a for a in [*available, *plugins]}
    out = []
    for name in filter(None, names):
        hit = short.get(name.lower().removesuffix("executionprovider"))
        if hit is None:
            raise LoracError(f"--ort-providers: this onnxruntime has no {name}; it has {', '.join(available)} "
                             f"(and, as a plugin, {', '.join(plugins)})")
        out.append(hit)
    if not out:
        raise LoracError("--ort-providers names no execution provider")
    return out


class HostValues:
    """OrtValues in memory onnxruntime's Python API reads and writes directly: the CPU's
    (sharing numpy's memory) or CUDA's."""

    def __init__(self, ort, device: str):
        self.ort, self.device = ort, device

    def empty(self, shape, dtype=np.float32):
        return self.ort.OrtValue.ortvalue_from_shape_and_type(list(shape), dtype, self.device, 0)

    def put(self, arrays: dict) -> dict:
        return {k: self.ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(a), self.device, 0)
                for k, a in arrays.items()}

    def read(self, values: list) -> list:
        return [v.numpy() for v in values]


class DeviceValues:
    """OrtValues on a plugin EP's device (WebGPU): opaque buffers, copied to and from the host
    by `copy` (onnxruntime.copy_tensors: the plugin's data transfer). Allocated from the
    memory info the EP's device entry declares (onnxruntime's shared allocator for it); where
    the entry declares none, or that allocation fails at the first tensor, from the allocator
    of a session on the device (`session()`: session-owned WebGPU values are usable by every
    session on the same WebGPU context)."""

    def __init__(self, ort, ep_device, session=None, copy=None):
        self.ort, self._session, self._allocator = ort, session, None
        self.info = ep_device.memory_info(ort.OrtDeviceMemoryType.DEFAULT)
        self.copy = copy or ort.copy_tensors
        self.allocated = 0
        self.how = "the device entry's memory info" if self.info is not None else "a session's allocator"

    def empty(self, shape, dtype=np.float32):
        if self.info is not None:
            try:
                v = self.ort.OrtValue.ortvalue_from_shape_and_type(list(shape), dtype, memory_info=self.info)
                self.allocated += 1
                return v
            except RuntimeError as e:
                if self.allocated or self._session is None:
                    raise
                self.info, self.how = None, f"a session's allocator (the memory info's failed: {e})"
        if self._session is None:
            raise LoracError("onnxruntime's WebGPU device entry declares no memory to allocate from")
        if self._allocator is None:
            self._allocator = self._session()
        self.allocated += 1
        return self._allocator.create_ortvalue_from_shape_and_type(list(shape), dtype, "webgpu", 0)

    def put(self, arrays: dict) -> dict:
        host = {k: np.ascontiguousarray(a) for k, a in arrays.items()}
        out = {k: self.empty(a.shape, a.dtype) for k, a in host.items()}
        if out:
            self.copy([self.ort.OrtValue.ortvalue_from_numpy(a) for a in host.values()], list(out.values()))
        return out

    def read(self, values: list) -> list:
        host = [self.ort.OrtValue.ortvalue_from_shape_and_type(v.shape(), v.element_type()) for v in values]
        if host:
            self.copy(list(values), host)
        return [h.numpy() for h in host]


class Readback:
    """A device scalar read when asked (.numpy()): step(read_loss=False)'s loss."""
    __slots__ = ("value", "values")

    def __init__(self, value, values):
        self.value, self.values = value, values

    def numpy(self) -> np.ndarray:
        return self.values.read([self.value])[0]


class Session:
    """One graph's InferenceSession and its IO binding. A value is bound again only when it
    changed: OrtValues by identity; numpy arrays (the batch, scalars) every call."""

    def __init__(self, ort, model, options, providers: list[str] | None):
        self.sess = ort.InferenceSession(model.SerializeToString(), options, providers=providers)
        self.inputs = [i.name for i in self.sess.get_inputs()]
        self.outputs = [o.name for o in self.sess.get_outputs()]
        self.io = self.sess.io_binding()
        self._bound: dict = {}

    def placement(self) -> dict[str, Counter]:
        """{execution provider: Counter of op types} of the session's nodes (empty where this
        onnxruntime does not record it)."""
        try:
            info = self.sess.get_provider_graph_assignment_info()
        except (AttributeError, RuntimeError):
            return {}
        out: dict[str, Counter] = {}
        for sub in info:
            out.setdefault(sub.ep_name, Counter()).update(n.op_type for n in sub.get_nodes())
        return out

    def _same(self, name: str, value) -> bool:
        old = self._bound.get(name)
        key = None if isinstance(value, np.ndarray) else id(value)
        self._bound[name] = (key, value)  # the value is kept: an id stays its object's, numpy stays alive
        return key is not None and old is not None and old[0] == key

    def run(self, inputs: dict, outputs: dict) -> None:
        """Bind `inputs` (name -> OrtValue or numpy array; extra names are ignored) and
        `outputs` (every output: name -> OrtValue), then run."""
        missing = [n for n in self.inputs if n not in inputs]
        if missing:
            raise LoracError(f"onnxruntime graph input(s) without a value: {', '.join(missing[:3])}")
        for name in self.inputs:
            v = inputs[name]
            if isinstance(v, np.ndarray):
                v = np.ascontiguousarray(v)
            if self._same(name, v):
                continue
            if isinstance(v, np.ndarray):  # onnxruntime copies it to wherever its readers run
                self.io.bind_cpu_input(name, v)
            else:
                self.io.bind_ortvalue_input(name, v)
        for name in self.outputs:
            v = outputs[name]
            if not self._same("out:" + name, v):
                self.io.bind_ortvalue_output(name, v)
        self.sess.run_with_iobinding(self.io)


class OrtEngine(Graphs):
    def __init__(self, spec, train, weights: dict, target: str = "cpu", dtype: str | None = None,
                 cache_dir=".lorac-cache", optim_cfg=None, log=None, providers=None, threads: int = 0,
                 profile: str | None = None):
        device = devices.for_target(target)
        memory = getattr(device, "ORT_MEMORY", None)
        if memory is None or target != device.NAME:
            raise LoracError(f"--backend ort keeps its buffers on cpu, cuda or webgpu (--target), not {target}; other "
                             "devices are reached with --ort-providers (buffers on the host: --target cpu)")
        if dtype not in (None, "float32"):
            raise LoracError(f"--backend ort computes in float32; --dtype {dtype} is for the TVM backend")
        super().__init__(spec, train, target, "float32", cache_dir, optim_cfg, log)
        self._ort = ort = _onnxruntime()
        self.providers = resolve_providers(providers or device.ORT_PROVIDERS, ort.get_available_providers())
        self.device, self.threads, self.profile = device.NAME, threads, profile
        self.adapter, self._ep_device = None, None
        webgpu = ort_webgpu.EP in self.providers
        if webgpu != (ort_webgpu.EP in device.ORT_PROVIDERS):  # the plugin's buffers are its device's
            raise LoracError("--ort-providers webgpu and --target webgpu go together (the WebGPU plugin keeps "
                             f"its buffers on its device); got --target {target} --ort-providers "
                             f"{','.join(self.providers)}")
        if webgpu:
            others = [p for p in self.providers if p not in (ort_webgpu.EP, "CPUExecutionProvider")]
            if others:
                raise LoracError(f"--ort-providers: the WebGPU plugin runs with the CPU provider as its fallback "
                                 f"only, not with {', '.join(others)}")
            self._ep_device, self.adapter = ort_webgpu.open_device(ort, ort_webgpu.options())
            host = os.environ.get("LORAC_ORT_WEBGPU_HOST", "") not in ("", "0")
            self._values = HostValues(ort, "cpu") if host else DeviceValues(ort, self._ep_device,
                                                                            session=self._allocator_session)
            self.log(f"onnxruntime {ort.__version__} WebGPU adapter: {self.adapter['vendor']} "
                     f"(vendor {self.adapter['vendor_id']}, device {self.adapter['device_id']}) through "
                     f"{self.adapter['graphics_api']}; buffers on the {'host' if host else 'device'}")
        else:
            self._values = HostValues(ort, memory)
        self._host_weights, self._weights = weights, None
        self._sessions: dict = {}
        self.placement: dict = {}  # graph kind -> {execution provider: Counter of op types}
        self._out: dict = {}  # preallocated outputs: losses, grad norm, skipped flag, logits

    def describe(self) -> dict:
        """What ran, for the run's summary: backend, providers, device (and the WebGPU adapter)."""
        out = {"backend": "ort", "onnxruntime": self._ort.__version__, "providers": list(self.providers),
               "target": self.device}
        if self.adapter:
            out["adapter"] = self.adapter
        return out

    def _options(self):
        so = self._ort.SessionOptions()
        if self.threads:
            so.intra_op_num_threads, so.inter_op_num_threads = self.threads, 1
        so.add_session_config_entry("session.record_ep_graph_assignment_info", "1")  # Session.placement
        if self.profile:
            so.enable_profiling, so.profile_file_prefix = True, self.profile
        if self._ep_device is not None:
            so.add_provider_for_devices([self._ep_device], ort_webgpu.options())
            ort_webgpu.configure(so, self._ort)
        return so

    def _allocator_session(self):
        """A one-node session on the plugin's device: the allocator of DeviceValues' fallback."""
        from onnx import TensorProto, helper
        g = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "lorac_allocator",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
        model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
        return self._ort.InferenceSession(model.SerializeToString(), self._options())

    def compile(self, kind: str) -> Session:
        """The onnxruntime session of graph `kind` (see Graphs._recipe), made on first use:
        onnxruntime optimizes the graph for its providers then."""
        if kind not in self._sessions:
            t0 = time.perf_counter()
            model = self._recipe(kind)[0]()
            providers = None if self._ep_device is not None else self.providers  # plugin: in the options
            s = self._sessions[kind] = Session(self._ort, model, self._options(), providers)
            where = self.placement[kind] = s.placement()
            self.log(f"onnxruntime {self._ort.__version__}: {kind.split(':')[0]} graph ({len(model.graph.node)} "
                     f"nodes) ready on {', '.join(s.sess.get_providers())} in {time.perf_counter() - t0:.1f} s"
                     + describe_placement(where, self.providers[0]))
        return self._sessions[kind]

    # -- device residency ---------------------------------------------------------------
    def _empty(self, key, shape):
        if key not in self._out:
            self._out[key] = self._values.empty(shape)
        return self._out[key]

    def _to_host(self, a) -> np.ndarray:
        return a if isinstance(a, np.ndarray) else self._values.read([a])[0]

    def _session(self, kind: str) -> tuple[Session, dict]:
        """(session of `kind`, the frozen weights as device values): uploaded for the first graph."""
        s = self.compile(kind)
        if self._weights is None:
            self._missing_weights(s.inputs, self._host_weights)
            # weights in float32; a quantized weight's integer blocks and codes as they are (graphs/ops/quant.py)
            self._weights = self._values.put({n: np.asarray(a) if np.asarray(a).dtype.kind in "iu" else
                                              np.asarray(a, np.float32) for n, a in self._host_weights.items()
                                              if n in s.inputs})
            self._host_weights = None  # the device holds them now
        else:
            self._missing_weights(s.inputs, self._weights)
        return s, self._weights

    # -- LoRA + optimizer state: flat per-bucket buffers ----------------------------------
    def set_state(self, lora: dict, m: dict, v: dict) -> None:
        from lorac.graphs.optimizer import pack
        put = lambda d: self._values.put(pack(self._buckets, d))
        self._p, self._m, self._v = put(lora), put(m), put(v)
        spare = lambda: {b.key: self._values.empty((b.size,)) for b in self._buckets}
        self._next = spare(), spare(), spare()
        self._g = spare()
        if getattr(self._values, "how", None):  # which of DeviceValues' allocators serves the device
            self.log(f"{self.device} buffers: allocated from {self._values.how}")

    @property
    def lora(self) -> dict:
        """The current LoRA tensors as the graphs take them: {"<bucket>.param": flat device value}."""
        return {f"{k}.param": t for k, t in self._p.items()}

    def state_numpy(self):
        """(lora, m, v) as per-tensor numpy arrays (checkpoints, export): one copy call for all."""
        from lorac.graphs.optimizer import unpack
        keys = list(self._p)
        flats = self._values.read([d[k] for d in (self._p, self._m, self._v) for k in keys])
        n = len(keys)
        return tuple({name: a.copy() for name, a in unpack(self._buckets, dict(zip(keys, flats[i * n:(i + 1) * n])))
                      .items()} for i in range(3))

    # -- the graphs -----------------------------------------------------------------------
    def step(self, batch: dict, lora: dict, read_loss: bool = True) -> dict:
        """Loss (a float; with read_loss=False an object whose .numpy() reads it) and the flat
        gradients {"<bucket>.grad": device value} (the engine's buffers: the next step
        overwrites them)."""
        s, weights = self._session("train")
        grads = {f"{k}.grad": g for k, g in self._g.items()}
        loss = self._empty("loss", ())
        s.run({**weights, **self._flat(lora, ".param"), **batch}, {"loss": loss, **grads})
        return {"loss": float(self._to_host(loss)) if read_loss else Readback(loss, self._values), **grads}

    def eval_loss(self, batch: dict, lora: dict) -> float:
        s, weights = self._session("eval")
        loss = self._empty("eval_loss", ())
        s.run({**weights, **self._flat(lora, ".param"), **batch}, {"loss": loss})
        return float(self._to_host(loss))

    def update(self, grads: dict, lr_a: float, lr_b: float, t: int, grad_share: float = 1.0):
        """One LoRA+ AdamW step over the flat state -> (grad_norm, skipped); a skipped step
        (non-finite gradient norm) leaves the state as it was. `grads`: step()'s, or host
        arrays (flat, or per tensor: summed over micro-batches on the host)."""
        s = self.compile("adamw")
        flat = self._flat(grads, ".grad")
        p2, m2, v2 = self._next
        ins = {"lr_a": np.array(lr_a, np.float32), "lr_b": np.array(lr_b, np.float32), "step": np.array(t, np.float32)}
        outs = {"grad_norm": self._empty("grad_norm", ()), "skipped": self._empty("skipped", ())}
        for k in self._p:
            ins.update({f"{k}.param": self._p[k], f"{k}.grad": flat[f"{k}.grad"], f"{k}.m": self._m[k],
                        f"{k}.v": self._v[k]})
            outs.update({f"{k}.param.new": p2[k], f"{k}.m.new": m2[k], f"{k}.v.new": v2[k]})
        s.run(ins, outs)
        norm, skipped = (float(x) for x in self._values.read([outs["grad_norm"], outs["skipped"]]))
        if not skipped:
            self._next = self._p, self._m, self._v
            self._p, self._m, self._v = p2, m2, v2
        return norm, bool(skipped)

    def logits(self, ids: np.ndarray, lora: dict) -> np.ndarray:
        """Logits [B', S', V] of a forward graph for ids' shape (one session per shape)."""
        kind = f"forward:{ids.shape[0]},{ids.shape[1]}"
        s, weights = self._session(kind)
        out = self._empty(kind, (ids.shape[0], ids.shape[1], self.spec.vocab))
        s.run({**weights, **self._flat(lora, ".param"), "input_ids": ids}, {"logits": out})
        return np.array(self._to_host(out))

    def end_profiling(self) -> list[str]:
        """With `profile`: end every session's profile -> the JSON trace files onnxruntime wrote."""
        return [s.sess.end_profiling() for s in self._sessions.values()] if self.profile else []


def describe_placement(where: dict, main: str) -> str:
    """"; nodes placed (units inlined, optimized): 1068 on WebGpuExecutionProvider, 6 on
    CPUExecutionProvider (Cast, Concat, ...)" (the op types named for every provider but
    `main`); "" when nothing was recorded."""
    if not where:
        return ""
    parts = []
    for ep in sorted(where, key=lambda e: (e != main, e)):
        ops = where[ep]
        named = "" if ep == main else f" ({', '.join(sorted(ops))})"
        parts.append(f"{sum(ops.values())} on {ep}{named}")
    return "; nodes placed (units inlined, optimized): " + ", ".join(parts)
