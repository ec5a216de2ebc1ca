"""The onnxruntime backend: the TVM engine's methods (runtime/engine/tvm.py) over the same training, eval,
forward and LoRA+ AdamW graphs (lorac.graphs), run by onnxruntime on any of its execution
providers (CPU, CUDA, TensorRT, ROCm/MIGraphX, DirectML, CoreML, OpenVINO, WebGPU, ...).
`lorac train --backend ort` is therefore the same loop with the same checkpoints.

    eng = OrtEngine(spec, train, weights, target="cpu", providers="CPUExecutionProvider")

Needs onnxruntime (pip install 'lorac[ort]', or the onnxruntime build for the device); no
TVM, no torch. fp32 only (the bf16 mode is a TVM compiler pass).

Residency, through IO binding: the frozen weights are OrtValues on the device, bound once.
The LoRA tensors, AdamW moments and gradients live in flat per-bucket device buffers
(graphs/optimizer.Bucket), as in the TVM engine: the training step reads each LoRA tensor
as a window of the flat parameter buffer and writes each gradient into a window of the flat
gradient buffer (bound by address: no copies); the optimizer graph reads those and writes
the next parameters and moments into a second set of buffers (an output bound over an
input is not allowed in onnxruntime), which become the current ones unless the step was
skipped. Per step only ids and labels go to the device; the loss and grad norm come back.
`target` says where the buffers live: cpu, or cuda (CUDA/TensorRT providers); a provider
of another device computes there from host buffers that onnxruntime copies in and out.
"""
from __future__ import annotations

import time

import numpy as np

from .. import devices
from .graphs import Graphs
from ..errors import LoracError


def _onnxruntime():
    try:
        import onnxruntime
    except ImportError:
        raise LoracError("--backend ort needs onnxruntime: pip install 'lorac[ort]' (or the onnxruntime build "
                         "for your device, such as onnxruntime-gpu)") from None
    return onnxruntime


def resolve_providers(asked, available: list[str]) -> list[str]:
    """Execution providers from --ort-providers ("CUDAExecutionProvider,CPUExecutionProvider",
    or short and in any case: "cuda,cpu"), each one this onnxruntime build has."""
    names = [n.strip() for n in asked.split(",")] if isinstance(asked, str) else list(asked)
    short = {a.lower().removesuffix("executionprovider"): a for a in available}
    out = []
    for name in filter(None, names):
        hit = short.get(name.lower().removesuffix("executionprovider"))
        if hit is None:
            raise LoracError(f"--ort-providers: this onnxruntime has no {name}; it has {', '.join(available)}")
        out.append(hit)
    if not out:
        raise LoracError("--ort-providers names no execution provider")
    return out


class Window:
    """A float32 tensor of `shape` at element `offset` of a flat OrtValue: bound by address
    (a LoRA input, a gradient output); numpy() copies it to the host."""
    __slots__ = ("flat", "offset", "shape", "size")

    def __init__(self, flat, offset: int, shape: tuple):
        self.flat, self.offset, self.shape = flat, offset, tuple(shape)
        self.size = int(np.prod(shape))

    def address(self) -> int:
        return self.flat.data_ptr() + 4 * self.offset

    def numpy(self) -> np.ndarray:
        return self.of(self.flat.numpy())

    def of(self, host_flat: np.ndarray) -> np.ndarray:
        return host_flat[self.offset:self.offset + self.size].reshape(self.shape).copy()


class Session:
    """One graph's InferenceSession and its IO binding. A value is bound again only when it
    changed: OrtValues by identity, windows by address; numpy arrays every call."""

    def __init__(self, ort, model, providers: list[str], memory: str, threads: int = 0):
        so = ort.SessionOptions()
        if threads:
            so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
        self.sess = ort.InferenceSession(model.SerializeToString(), so, providers=providers)
        self.inputs = [i.name for i in self.sess.get_inputs()]
        self.outputs = [o.name for o in self.sess.get_outputs()]
        self.memory = memory
        self.io = self.sess.io_binding()
        self._bound: dict = {}

    def _same(self, name: str, value) -> bool:
        old = self._bound.get(name)
        if isinstance(value, Window):
            key = ("window", value.address())
        elif isinstance(value, np.ndarray):
            key = None
        else:
            key = ("value", id(value))
        self._bound[name] = (key, value)  # the value is kept: an id stays its object's
        return key is not None and old is not None and old[0] == key

    def run(self, inputs: dict, outputs: dict) -> None:
        """Bind `inputs` (name -> OrtValue, Window or numpy array; extra names are ignored)
        and `outputs` (every output: name -> OrtValue or Window), then run."""
        missing = [n for n in self.inputs if n not in inputs]
        if missing:
            raise LoracError(f"onnxruntime graph input(s) without a value: {', '.join(missing[:3])}")
        for name in self.inputs:
            v = inputs[name]
            if isinstance(v, np.ndarray):  # kept (in _bound) until the next call: the CPU binds its memory
                v = np.ascontiguousarray(v)
            if self._same(name, v):
                continue
            if isinstance(v, Window):
                self.io.bind_input(name, self.memory, 0, np.float32, v.shape, v.address())
            elif isinstance(v, np.ndarray):
                self.io.bind_cpu_input(name, v)
            else:
                self.io.bind_ortvalue_input(name, v)
        for name in self.outputs:
            v = outputs[name]
            if self._same("out:" + name, v):
                continue
            if isinstance(v, Window):
                self.io.bind_output(name, self.memory, 0, np.float32, v.shape, v.address())
            else:
                self.io.bind_ortvalue_output(name, v)
        self.sess.run_with_iobinding(self.io)


class OrtEngine(Graphs):
    def __init__(self, spec, train, weights: dict, target: str = "cpu", dtype: str | None = None,
                 cache_dir=".lorac-cache", optim_cfg=None, log=None, providers=None, threads: int = 0):
        device = devices.for_target(target)
        memory = getattr(device, "ORT_MEMORY", None)
        if memory is None or target != device.NAME:
            raise LoracError(f"--backend ort keeps its buffers on cpu or cuda (--target), not {target}; other "
                             "devices are reached with --ort-providers (buffers on the host: --target cpu)")
        if dtype not in (None, "float32"):
            raise LoracError(f"--backend ort computes in float32; --dtype {dtype} is for the TVM backend")
        super().__init__(spec, train, target, "float32", cache_dir, optim_cfg, log)
        self._ort = _onnxruntime()
        self.providers = resolve_providers(providers or device.ORT_PROVIDERS, self._ort.get_available_providers())
        self.device, self.memory, self.threads = device.NAME, memory, threads
        self._host_weights, self._weights = weights, None
        self._sessions: dict = {}
        self._out: dict = {}  # preallocated outputs: losses, grad norm, skipped flag, logits

    def compile(self, kind: str) -> Session:
        """The onnxruntime session of graph `kind` (see Graphs._recipe), made on first use:
        onnxruntime optimizes the graph for its providers then."""
        if kind not in self._sessions:
            t0 = time.perf_counter()
            model = self._recipe(kind)[0]()
            s = self._sessions[kind] = Session(self._ort, model, self.providers, self.memory, self.threads)
            self.log(f"onnxruntime {self._ort.__version__}: {kind.split(':')[0]} graph ({len(model.graph.node)} "
                     f"nodes) ready on {', '.join(s.sess.get_providers())} in {time.perf_counter() - t0:.1f} s")
        return self._sessions[kind]

    # -- device residency ---------------------------------------------------------------
    def _value(self, arr: np.ndarray):
        """An OrtValue on the buffers' device holding `arr` (on the CPU: sharing its memory)."""
        return self._ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(arr, np.float32), self.memory, 0)

    def _empty(self, key, shape):
        if key not in self._out:
            self._out[key] = self._ort.OrtValue.ortvalue_from_shape_and_type(list(shape), np.float32, self.memory, 0)
        return self._out[key]

    def _session(self, kind: str) -> tuple[Session, dict]:
        """(session of `kind`, the frozen weights as device values): uploaded for the first graph."""
        s = self.compile(kind)
        if self._weights is None:
            self._missing_weights(s.inputs, self._host_weights)
            self._weights = {n: self._value(a) for n, a in self._host_weights.items() if n in s.inputs}
            self._host_weights = None  # the device holds them now
        else:
            self._missing_weights(s.inputs, self._weights)
        return s, self._weights

    # -- LoRA + optimizer state: flat per-bucket buffers ----------------------------------
    def set_state(self, lora: dict, m: dict, v: dict) -> None:
        from lorac.graphs.optimizer import buckets, pack
        self._buckets = buckets(self.shapes)
        put = lambda d: {k: self._value(x) for k, x in pack(self._buckets, d).items()}
        self._p, self._m, self._v = put(lora), put(m), put(v)
        spare = lambda name: {b.key: self._empty((name, b.key), (b.size,)) for b in self._buckets}
        self._next = spare("p"), spare("m"), spare("v")
        self._g = spare("g")
        self._g_views = self._windows(self._g)
        self._views = self._windows(self._p)

    @property
    def lora(self) -> dict:
        """The current LoRA tensors, windows into the flat parameters (feed them to step / eval / logits)."""
        return self._views

    def _windows(self, flats: dict) -> dict:
        return {n: Window(flats[b.key], off, s) for b in self._buckets for n, off, s in b.entries}

    def host(self, tensors: dict) -> dict:
        """Numpy copies of a step's outputs; each flat buffer is copied to the host once."""
        flats: dict = {}
        out = {}
        for n, a in tensors.items():
            if isinstance(a, Window):
                if id(a.flat) not in flats:
                    flats[id(a.flat)] = a.flat.numpy()
                out[n] = a.of(flats[id(a.flat)])
            else:
                out[n] = a if isinstance(a, np.ndarray) else a.numpy()
        return out

    # -- the graphs -----------------------------------------------------------------------
    def step(self, batch: dict, lora: dict, read_loss: bool = True) -> dict:
        """Loss (a float; with read_loss=False the output holding it, read with .numpy())
        and gradients (windows of the flat gradient buffer)."""
        s, weights = self._session("train")
        grads = {f"{n}.grad": self._g_views[n] for n in self.names}
        loss = self._empty("loss", ())
        s.run({**weights, **lora, **batch}, {"loss": loss, **grads})
        return {"loss": float(loss.numpy()) if read_loss else loss, **grads}

    def eval_loss(self, batch: dict, lora: dict) -> float:
        s, weights = self._session("eval")
        loss = self._empty("eval_loss", ())
        s.run({**weights, **lora, **batch}, {"loss": loss})
        return float(loss.numpy())

    def update(self, grads: dict, lr_a: float, lr_b: float, t: int, grad_share: float = 1.0):
        """One LoRA+ AdamW step over the flat state -> (grad_norm, skipped); a skipped step
        (non-finite gradient norm) leaves the state as it was."""
        from lorac.graphs.optimizer import pack
        s = self.compile("adamw")
        if any(grads[f"{n}.grad"] is not self._g_views[n] for n in self.names):  # summed on the host
            for k, flat in pack(self._buckets, {n: grads[f"{n}.grad"] for n in self.names}).items():
                self._g[k].update_inplace(flat)
        p2, m2, v2 = self._next
        ins = {"lr_a": np.array(lr_a, np.float32), "lr_b": np.array(lr_b, np.float32), "step": np.array(t, np.float32)}
        outs = {"grad_norm": self._empty("grad_norm", ()), "skipped": self._empty("skipped", ())}
        for k in self._p:
            ins.update({f"{k}.param": self._p[k], f"{k}.grad": self._g[k], f"{k}.m": self._m[k], f"{k}.v": self._v[k]})
            outs.update({f"{k}.param.new": p2[k], f"{k}.m.new": m2[k], f"{k}.v.new": v2[k]})
        s.run(ins, outs)
        skipped = bool(float(outs["skipped"].numpy()))
        if not skipped:
            self._next = self._p, self._m, self._v
            self._p, self._m, self._v = p2, m2, v2
            self._views = self._windows(self._p)
        return float(outs["grad_norm"].numpy()), skipped

    def logits(self, ids: np.ndarray, lora: dict) -> np.ndarray:
        """Logits [B', S', V] of a forward graph for ids' shape (one session per shape)."""
        kind = f"forward:{ids.shape[0]},{ids.shape[1]}"
        s, weights = self._session(kind)
        out = self._empty(kind, (ids.shape[0], ids.shape[1], self.spec.vocab))
        s.run({**weights, **lora, "input_ids": ids}, {"logits": out})
        return out.numpy().copy()
