"""The compiled pieces of one training setup, with the frozen weights resident on the device.

    eng = Engine(spec, train, weights, target="cpu", cache_dir=".lorac-cache")   # TVM artifacts
    eng = make_engine("ort", spec, train, weights, providers="CPUExecutionProvider")  # onnxruntime
    eng.set_state(lora, m, v)             # LoRA + AdamW state, resident on the device
    out = eng.step(batch, eng.lora)       # loss + LoRA gradients (device tensors)
    grad_norm, skipped = eng.update(out, lr_a, lr_b, t)   # one LoRA+ AdamW step, in place
    eng.eval_loss(batch, eng.lora); eng.logits(ids, eng.lora); lora, m, v = eng.state_numpy()

Each graph (training step, eval loss, optimizer, forward) is emitted by lorac.graphs and
compiled once per (graph key, target, dtype): a second run, or a resumed one, reuses the
artifact from the cache folder without importing the compiler. A graph's key is a digest of
everything it is emitted from, whole (graph_key: every field of the specs, the optimizer's
baked constants, lorac's version and the source of core, graphs and compiler). Frozen
weights are uploaded once and passed to every call as device tensors. The graphs take the
LoRA tensors as the optimizer's flat buckets and write their gradients the same way
(graphs/flat_lora.py): a step copies no tensor one by one. The onnxruntime backend
(runtime/engine/ort.py) runs the same graphs behind the same methods (Graphs holds what both
share).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from lorac.core.dtypes import as_dtype

from .. import devices
from .artifact import load_artifact
from .graphs import Graphs, compiled, graph_key, release_host_memory
from ..errors import LoracError


class Engine(Graphs):
    """The TVM backend: compiled artifacts (lorac.compiler), run by TVM's runtime on `target`'s device."""

    def __init__(self, spec, train, weights: dict, target: str = "cpu", dtype: str | None = None,
                 cache_dir=".lorac-cache", optim_cfg=None, log=None, cuda_graph: bool = True, ranks: int = 1,
                 tune: int = 0, host_tables: tuple = ()):
        device = devices.for_target(target)
        super().__init__(spec, train, target, dtype or device.DEFAULT_DTYPE, cache_dir, optim_cfg, log, ranks)
        self.device = device.NAME
        # on CUDA the training step runs as a few CUDA graphs (the host issued ~15,000 calls a
        # step otherwise: docs/BENCHMARKS.md); eval, forward and AdamW run as plain VM calls
        self.cuda_graph = cuda_graph and getattr(device, "CAPTURES_GRAPHS", False)
        self.tune = tune  # MetaSchedule trials for the training step's kernels (0: default schedules)
        # frozen tables (HF names) held in host memory the device reads in place (--offload-embeddings):
        # every input of the table's (a quantized table's blocks and scales too)
        self.host_tables = tuple(host_tables)
        if self.host_tables and device.host_table is None:
            raise LoracError(f"--offload-embeddings: device {device.NAME} reads no tables from host memory")
        # uploaded by the first artifact loaded, then dropped: a dict of its own, emptied as each
        # tensor is copied, so a caller that let go of its arrays sees each freed as it goes
        self._host_weights = None if weights is None else dict(weights)
        self._weights = None
        self._arts: dict = {}
        self._p = None  # set_state: {bucket key: flat device tensor}, also _m, _v
        self._g = None  # data parallel only: the flat gradients the grad_reducer sums in place
        self._pushed: dict = {}  # id(bound-input step) -> the flat params last copied into its buffers

    def compile(self, kind: str) -> Path:
        """The artifact directory of graph `kind`, compiled into the cache if missing (no device needed)."""
        build, parts, dtype = self._recipe(kind)
        name = kind.split(":")[0]
        return compiled(build, graph_key(name, *parts), name, self.target, dtype, self.cache_dir, self.log,
                        cuda_graph=self.cuda_graph and name == "train", tune=self.tune if name == "train" else 0)

    def _artifact(self, kind: str):
        """The loaded artifact of graph `kind`, compiled on first use."""
        if kind not in self._arts:
            step = load_artifact(self.compile(kind), self.device)
            from ..limits import check_plan
            check_plan(step.manifest, devices.get(self.device), kind.split(":")[0])  # before its first call allocates it
            self._arts[kind] = step
            if kind == "train":
                from lorac.graphs.families import for_spec
                self.log(memory_summary(step.manifest, self.shapes, self.device, for_spec(self.spec).EMBEDDINGS,
                                        self.host_tables))
            if kind != "adamw" and self._weights is None:
                self._weights = self._upload(step, self._host_weights)
                self._host_weights = None  # the device holds them now
                release_host_memory()
            elif kind != "adamw" and step.bound_inputs:
                # its CUDA graphs read its own input buffers: move the weights there once; the
                # other artifacts take any device tensor, so all share that one copy
                self._weights = self._upload(step, self._weights)
        return self._arts[kind]

    # -- device residency ---------------------------------------------------------------
    def _upload(self, step, tensors: dict) -> dict:
        """Device copies of the tensors `step` takes (dtype converted per its manifest), each
        taken out of `tensors` as it is copied: the host holds one copy of the weights at a
        time, not two (a CPU "device" copy is host memory too)."""
        specs = {i["name"]: i for i in step.inputs}
        self._missing_weights(specs, tensors)
        return {n: self._place(step, specs[n], tensors.pop(n)) for n in [n for n in tensors if n in specs]}

    def _place(self, step, spec: dict, value):
        """`value` where `step` reads input `spec`: on the device (Step.upload), or for a table held in
        host memory, copied once into pinned host memory the device maps and then passed as it is."""
        if not _of_tables(spec["name"], self.host_tables):
            return step.upload(spec, value)
        if isinstance(value, np.ndarray):
            arr = step.checked(spec, value)  # converted to the artifact's dtype
            value, view = devices.get(self.device).host_table(tuple(spec["shape"]), spec["dtype"])
            view[...] = arr
        return step.adopt(spec, value)

    # -- LoRA + optimizer state: flat per-bucket device buffers (see graphs/optimizer.Bucket) --
    def set_state(self, lora: dict, m: dict, v: dict) -> None:
        from lorac.graphs.optimizer import pack
        import tvm
        dev = self._artifact("train")._dev
        put = lambda d: {k: tvm.runtime.tensor(x, dev) for k, x in pack(self._buckets, d).items()}
        self._p, self._m, self._v = put(lora), put(m), put(v)
        self._pushed.clear()

    @property
    def lora(self) -> dict:
        """The current LoRA tensors as the graphs take them: {"<bucket>.param": flat device tensor}."""
        return {f"{k}.param": t for k, t in self._p.items()}

    def _feed(self, step, lora: dict) -> dict:
        """`lora` (self.lora, or per-tensor arrays) as `step` takes it: flat buckets. A step with
        bound inputs reads its own buffers, into which the engine copies the current
        parameters once per update (_push_lora): then the call passes those buffers and
        copies nothing."""
        flat = self._flat(lora, ".param")
        if not step.bound_inputs or self._p is None or any(flat[f"{k}.param"] is not t for k, t in self._p.items()):
            return flat
        if self._pushed.get(id(step)) is not self._p:
            self._push_lora(step)
        return {n: step.upload_target(n) for n in flat}

    def _push_lora(self, step) -> None:
        """Copy the current flat parameters into a bound-input step's own buffers (device-side,
        enqueued: update() does it for the train step before it waits)."""
        for k, t in self._p.items():
            step.upload(step.input_spec(f"{k}.param"), t)
        self._pushed[id(step)] = self._p

    # -- the compiled calls -------------------------------------------------------------
    def step(self, batch: dict, lora: dict, read_loss: bool = True) -> dict:
        """Loss and gradients (device tensors; `loss` as a float, or with read_loss=False the
        device tensor: reading it waits for the step, so a caller that reads it after
        enqueueing the update keeps the device busy meanwhile)."""
        step = self._artifact("train")
        out = step({**self._weights, **self._feed(step, lora), **batch}, as_numpy=False)
        if read_loss:
            out["loss"] = float(out["loss"].numpy())
        return out

    def eval_loss(self, batch: dict, lora: dict) -> float:
        step = self._artifact("eval")
        return float(step({**self._weights, **self._feed(step, lora), **batch}, as_numpy=False)["loss"].numpy())

    def update(self, grads: dict, lr_a: float, lr_b: float, t: int, grad_share: float = 1.0):
        """One LoRA+ AdamW step on the device over the flat state -> (grad_norm, skipped).
        A skipped step (non-finite gradient norm) leaves the state as it was. With a
        grad_reducer, the flat gradients are first summed over the workers, each weighted by
        its `grad_share` of the batch."""
        opt = self._artifact("adamw")
        flat = self._flat(grads, ".grad")
        if self.grad_reducer is not None:  # summed in place over the workers: the engine's own buffers
            if self._g is None:
                import tvm
                self._g = {k: tvm.runtime.empty((x.shape[0],), "float32", x.device) for k, x in self._p.items()}
            for k, g in flat.items():
                buf = self._g[k[:-len(".grad")]]
                if isinstance(g, np.ndarray):
                    buf.copyfrom(np.ascontiguousarray(g, np.float32))
                else:
                    g.copyto(buf)
            self.grad_reducer(self._g, grad_share)
            flat = {f"{k}.grad": t for k, t in self._g.items()}
        feeds = {}
        for k in self._p:
            feeds.update({f"{k}.param": self._p[k], f"{k}.grad": flat[f"{k}.grad"], f"{k}.m": self._m[k], f"{k}.v": self._v[k]})
        feeds.update(lr_a=np.float32(lr_a), lr_b=np.float32(lr_b), step=np.float32(t))
        out = opt(feeds, as_numpy=False)
        # a skipped step's outputs are its inputs bit for bit (the graph's Where), so the new
        # state is taken before the flag is read: the device runs on while the host works
        self._p = {k: out[f"{k}.param.new"] for k in self._p}
        self._m = {k: out[f"{k}.m.new"] for k in self._m}
        self._v = {k: out[f"{k}.v.new"] for k in self._v}
        train = self._arts.get("train")
        if train is not None and train.bound_inputs:
            self._push_lora(train)
        return float(out["grad_norm"].numpy()), bool(float(out["skipped"].numpy()))

    def logits(self, ids: np.ndarray, lora: dict) -> np.ndarray:
        """Logits [B', S', V] of a forward graph compiled for ids' shape (cached per shape)."""
        step = self._artifact(f"forward:{ids.shape[0]},{ids.shape[1]}")
        # the forward artifact takes the frozen weights in the same dtypes: share the device copies
        return step({**self._weights, **self._feed(step, lora), "input_ids": ids})["logits"]


def _of_tables(name: str, tables: tuple) -> bool:
    """Whether artifact input `name` is one of `tables` (HF names) or, for a quantized one, one of its
    blocks and scales (the table's name plus a suffix: graphs/ops/quant.py)."""
    return any(name == t or name.startswith(f"{t}.") for t in tables)


def memory_summary(manifest, lora_shapes: dict, device: str, tables: tuple = (), host: tuple = ()) -> str:
    """One line on what a training step holds on its device: the compiled step's static
    plan (activations and workspace), the frozen weights as the artifact takes them (the
    quantized embedding tables among them said apart: `tables`, the family's EMBEDDINGS; the
    tables in `host` wait in host memory: --offload-embeddings), and the LoRA tensors with their
    gradients and AdamW moments (fp32)."""
    plan = manifest.static_plan_bytes
    size = lambda i: int(np.prod(i["shape"])) * as_dtype(i["dtype"]).itemsize
    on_host = [i for i in manifest.inputs if _of_tables(i["name"], host)]
    inputs = [i for i in manifest.inputs if not _of_tables(i["name"], host)]
    frozen = sum(size(i) for i in inputs if i["name"].endswith((".weight", ".bias")) and "lora_" not in i["name"])
    # a quantized weight's inputs are its name plus a suffix (graphs/ops/quant.py): blocks and scales
    packed = sum(size(i) for i in inputs if ".weight." in i["name"] and "lora_" not in i["name"])
    state = 4 * 4 * sum(int(np.prod(s)) for s in lora_shapes.values())
    gb = lambda n: f"{n / 1e9:.1f} GB"
    quantized = f" + quantized weights {gb(packed)}" if packed else ""
    embedded = sum(size(i) for i in inputs if i["name"].startswith(tuple(f"{t}." for t in tables)))
    if embedded:
        quantized += f" (of which embeddings {gb(embedded)})"
    if on_host:
        quantized += f" (and {gb(sum(size(i) for i in on_host))} of embeddings in host memory)"
    return (f"{device} memory for training: step activations and workspace {gb(plan)} (static plan), frozen "
            f"weights {gb(frozen)}{quantized}, LoRA tensors + gradients + AdamW moments {gb(state)}; total "
            f"{gb(plan + frozen + packed + state)} before library workspaces (--checkpointing and --keep-layers trade "
            "activation memory for time)")
