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
weights are uploaded once and passed to every call as device tensors. The TVM engine's
graphs take the LoRA tensors as the optimizer's flat buckets and write their gradients the
same way (graphs/flat_lora.py): a step copies no tensor one by one. The onnxruntime backend
(engine_ort.py) runs the per-tensor graphs behind the same methods (Graphs holds what
both share).
"""
from __future__ import annotations

import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from lorac.core import artifact_cache
from lorac.core.dtypes import as_dtype
from lorac.core.keys import digest, versions
from lorac.core.loraplus import AdamWConstants

from .. import devices
from .artifact import load_artifact
from ..errors import LoracError


BATCH_INPUTS = ("input_ids", "labels", "position_ids")  # what a batch feeds (position_ids: isolated packing)


def graph_key(kind: str, *parts) -> str:
    """Identity of a graph from what it is emitted from: `kind`, every field of each spec in
    `parts` (lorac.core.keys.canonical: fields out of a dataclass's repr count too), lorac's
    version and the source of core, graphs and compiler. A cached artifact is found without
    re-emitting the graph, on any machine with the same sources (the runtime-only GPU machine
    has neither the compiler nor lorac's onnx pin). TVM's version is not part of it: the
    artifact is compiled once and may run under another TVM runtime that loads it."""
    v = versions()
    return digest(kind, v["lorac_version"], v["lorac_source"], *parts)


def compiled(build, key: str, kind: str, target: str, dtype: str, cache_dir, log=None, cuda_graph: bool = False,
             tune: int = 0):
    """Path of the artifact of graph `key`, emitting (`build()`) and compiling it on a cache miss.
    An entry that fails verification (core/artifact_cache.py) is rebuilt; one builder per entry at a
    time (others wait for it and then find it built). cuda_graph: build with CUDA graphs
    (inputs bound: compiler/target_cuda.binds_inputs); tune: MetaSchedule trials (compiler/tune.py;
    the database lands in cache_dir/.lorac-tuning)."""
    tuned = f"-tune{tune}" if tune else ""
    art = Path(cache_dir) / f"{kind}-{target}{'-graph' if cuda_graph else ''}-{dtype}{tuned}-{key[:16]}"
    if artifact_cache.problem(art) is None:
        return art
    log = log or (lambda msg: None)
    with artifact_cache.build_lock(art, log):
        bad = artifact_cache.problem(art)  # built by the process we waited for?
        if bad is None:
            return art
        if bad != "missing":
            log(f"cache entry {art.name} is unusable ({bad}); rebuilding it")
        try:
            from lorac.compiler import compile_graph  # the compiler is needed only on a cache miss
        except ImportError as e:
            why = "is missing" if bad == "missing" else f"is unusable ({bad})"
            raise LoracError(f"cache entry {art} {why}, and this machine cannot compile it "
                             f"({e}); compile it where lorac's compile extra is installed") from None
        t0 = time.perf_counter()
        model = build()
        how = f", tuning {tune} trials first" if tune else ""
        log(f"compiling the {kind} graph for {target} ({dtype}, {len(model.graph.node)} nodes{how}) ...")
        compile_graph(model, target={"kind": target, "cuda_graph": True} if cuda_graph else target, out_dir=art,
                      dtype=dtype, tune=tune, force=True)
        log(f"compiled the {kind} graph in {time.perf_counter() - t0:.1f} s -> {art}")
    return art


class Graphs:
    """What the engines of every backend share: the specs, the LoRA tensors' names and shapes,
    the training graph's identity (what a checkpoint must match) and how each graph is emitted."""

    def __init__(self, spec, train, target: str, dtype: str, cache_dir, optim_cfg, log, ranks: int = 1):
        from lorac.graphs import lora_tensor_names
        self.spec, self.train, self.target, self.dtype = spec, train, target, dtype
        self.cache_dir, self.log = Path(cache_dir), log or (lambda msg: print(msg, file=sys.stderr))
        self.names = lora_tensor_names(spec, train)
        self.shapes = {n: _lora_shape(spec, train, n) for n in self.names}
        self.optim_cfg = optim_cfg
        # what a checkpoint must match: the scan chunk length changes how the Mamba scan is
        # computed, not what, so a run may resume on a device whose default length differs; nor
        # does splitting the batch over `ranks` data-parallel workers (the whole batch's graph)
        same_math = replace(train, extra={k: v for k, v in train.extra.items() if k != "scan_chunk"},
                            batch=train.batch * ranks)
        self.graph_hash = graph_key("train", spec, same_math)
        self.grad_reducer = None  # data parallel: sums the flat gradients over the workers (distributed.py)

    def _recipe(self, kind: str):
        """(emit function, key parts, dtype) of graph `kind`: "train", "eval", "adamw" or
        "forward:B,S" (the forward graph for ids of shape [B, S])."""
        from lorac.graphs import TrainSpec, build_eval_graph, build_forward_graph, build_training_graph
        from lorac.graphs.optimizer import build_optimizer_graph
        if kind in ("train", "eval"):
            emit = build_training_graph if kind == "train" else build_eval_graph
            return (lambda: emit(self.spec, self.train)), (self.spec, self.train), self.dtype
        if kind == "adamw":  # lr and step are inputs; the graph is built from its key's constants alone
            c = AdamWConstants.of(self.optim_cfg)
            return (lambda: build_optimizer_graph(self.shapes, c)), (self.shapes, c), "float32"
        # generation: one document a row, so the plain causal graph (no position_ids) is exact
        b, s = (int(x) for x in kind.split(":")[1].split(","))
        t = self.train
        fwd = TrainSpec(batch=b, seq=s, lora_targets=t.lora_targets, rank=t.rank, alpha=t.alpha, rslora=t.rslora,
                        trained_layers=t.trained_layers, extra=t.extra)
        return (lambda: build_forward_graph(self.spec, fwd)), (self.spec, fwd), self.dtype

    @staticmethod
    def _missing_weights(wanted, have) -> None:
        """One error when the model's weights lack an input (other than the batch's, LoRA) a graph takes."""
        missing = [n for n in wanted if n not in have and n not in BATCH_INPUTS and "lora_" not in n]
        if missing:
            raise LoracError(f"model weights lack {len(missing)} tensor(s) the graph needs, e.g. {missing[0]}")

    def host(self, tensors: dict) -> dict:
        """Numpy copies of a step's outputs (gradients summed over micro-batches on the host)."""
        return {n: (a if isinstance(a, np.ndarray) else a.numpy()) for n, a in tensors.items()}

    # a backend's set_state keeps the LoRA+ AdamW state as flat per-bucket device buffers
    # (graphs/optimizer.Bucket): _buckets, _p, _m, _v (each {bucket key: tensor with .numpy()});
    # its `lora` property is what its step, eval_loss and logits take (the current LoRA tensors)

    def state_numpy(self):
        """(lora, m, v) as per-tensor numpy arrays (checkpoints, export)."""
        from lorac.graphs.optimizer import unpack
        get = lambda flats: {n: a.copy() for n, a in unpack(self._buckets, {k: t.numpy() for k, t in flats.items()}).items()}
        return get(self._p), get(self._m), get(self._v)


class Engine(Graphs):
    """The TVM backend: compiled artifacts (lorac.compiler), run by TVM's runtime on `target`'s device."""

    def __init__(self, spec, train, weights: dict, target: str = "cpu", dtype: str | None = None,
                 cache_dir=".lorac-cache", optim_cfg=None, log=None, cuda_graph: bool = True, ranks: int = 1,
                 tune: int = 0):
        device = devices.for_target(target)
        super().__init__(spec, train, target, dtype or device.DEFAULT_DTYPE, cache_dir, optim_cfg, log, ranks)
        self.device = device.NAME
        # on CUDA the training step runs as a few CUDA graphs (the host issued ~15,000 calls a
        # step otherwise: docs/BENCHMARKS.md); eval, forward and AdamW run as plain VM calls
        self.cuda_graph = cuda_graph and getattr(device, "CAPTURES_GRAPHS", False)
        self.tune = tune  # MetaSchedule trials for the training step's kernels (0: default schedules)
        self._host_weights = weights  # uploaded by the first artifact loaded, then dropped
        self._weights = None
        self._arts: dict = {}
        from lorac.graphs.optimizer import buckets
        self._buckets = buckets(self.shapes)
        self._p = None  # set_state: {bucket key: flat device tensor}, also _m, _v
        self._g = None  # data parallel only: the flat gradients the grad_reducer sums in place
        self._pushed: dict = {}  # id(bound-input step) -> the flat params last copied into its buffers

    def _recipe(self, kind: str):
        """The shared recipe with the LoRA tensors as flat buckets (graphs/flat_lora.py)."""
        from lorac.graphs.flat_lora import flat_lora_io
        build, parts, dtype = super()._recipe(kind)
        if kind == "adamw":
            return build, parts, dtype
        return (lambda: flat_lora_io(build(), self.shapes)), (*parts, "flat-lora"), dtype

    def compile(self, kind: str) -> Path:
        """The artifact directory of graph `kind`, compiled into the cache if missing (no device needed)."""
        build, parts, dtype = self._recipe(kind)
        name = kind.split(":")[0]
        return compiled(build, graph_key(name, *parts), name, self.target, dtype, self.cache_dir, self.log,
                        cuda_graph=self.cuda_graph and name == "train", tune=self.tune if name == "train" else 0)

    def _artifact(self, kind: str):
        """The loaded artifact of graph `kind`, compiled on first use."""
        if kind not in self._arts:
            step = self._arts[kind] = load_artifact(self.compile(kind), self.device)
            if kind == "train":
                self.log(memory_summary(step.manifest, self.shapes, self.device))
            if kind != "adamw" and self._weights is None:
                self._weights = self._upload(step, self._host_weights)
                self._host_weights = None  # the device holds them now
            elif kind != "adamw" and step.bound_inputs:
                # its CUDA graphs read its own input buffers: move the weights there once; the
                # other artifacts take any device tensor, so all share that one copy
                self._weights = self._upload(step, self._weights)
        return self._arts[kind]

    # -- device residency ---------------------------------------------------------------
    def _upload(self, step, tensors: dict) -> dict:
        """Device copies of the tensors `step` takes (dtype converted per its manifest)."""
        specs = {i["name"]: i for i in step.inputs}
        self._missing_weights(specs, tensors)
        return {n: step.upload(specs[n], a) for n, a in tensors.items() if n in specs}

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

    def _flat(self, tensors: dict, suffix: str) -> dict:
        """{"<bucket><suffix>": flat} from flat buckets as they are, or from per-tensor arrays
        ("<name><suffix-less>" keys, numpy or device) packed on the host."""
        from lorac.graphs.optimizer import pack
        keys = [f"{b.key}{suffix}" for b in self._buckets]
        if all(k in tensors for k in keys):
            return {k: tensors[k] for k in keys}
        plain = "" if suffix == ".param" else suffix  # per tensor: "<name>" and "<name>.grad"
        per = {n: (a if isinstance(a, np.ndarray) else a.numpy()) for n, a in
               ((n, tensors.get(n + plain)) for n in self.names) if a is not None}
        if len(per) != len(self.names):
            missing = next(n + plain for n in self.names if n not in per)
            raise LoracError(f"LoRA tensors: {missing} is missing")
        return {f"{k}{suffix}": x for k, x in pack(self._buckets, per).items()}

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


def memory_summary(manifest: dict, lora_shapes: dict, device: str) -> str:
    """One line on what a training step holds on its device: the compiled step's static
    plan (activations and workspace), the frozen weights as the artifact takes them, and
    the LoRA tensors with their gradients and AdamW moments (fp32)."""
    plan = manifest["memory"]["static_plan_bytes"]
    frozen = sum(int(np.prod(i["shape"])) * as_dtype(i["dtype"]).itemsize for i in manifest["inputs"]
                 if i["name"].endswith((".weight", ".bias")) and "lora_" not in i["name"])
    state = 4 * 4 * sum(int(np.prod(s)) for s in lora_shapes.values())
    gb = lambda n: f"{n / 1e9:.1f} GB"
    return (f"{device} memory for training: step activations and workspace {gb(plan)} (static plan), frozen "
            f"weights {gb(frozen)}, LoRA tensors + gradients + AdamW moments {gb(state)}; total "
            f"{gb(plan + frozen + state)} before library workspaces (--checkpointing and --keep-layers trade "
            "activation memory for time)")


def _lora_shape(spec, train, name: str) -> tuple[int, int]:
    target = name.split(".lora_")[0].rsplit(".", 1)[1]
    out, inp = spec.proj_shape(target)
    return (train.rank, inp) if ".lora_A." in name else (out, train.rank)


def make_engine(backend: str, spec, train, weights: dict, target: str = "cpu", dtype: str | None = None,
                cache_dir=".lorac-cache", optim_cfg=None, log=None, cuda_graph: bool = True, providers=None,
                ranks: int = 1, tune: int = 0):
    """The engine of `backend`: "tvm" (compiled artifacts) or "ort" (onnxruntime, `providers`);
    `ranks` data-parallel workers (distributed.py) and `tune` MetaSchedule trials on the TVM backend."""
    if backend == "ort":
        if ranks > 1:
            raise LoracError("data-parallel training (--gpus, mpiexec) runs on --backend tvm")
        from .ort import OrtEngine
        return OrtEngine(spec, train, weights, target, dtype, cache_dir, optim_cfg, log, providers=providers)
    if providers:
        raise LoracError("--ort-providers is for --backend ort")
    return Engine(spec, train, weights, target, dtype, cache_dir, optim_cfg, log, cuda_graph=cuda_graph, ranks=ranks,
                  tune=tune)
