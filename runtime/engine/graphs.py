"""What the engines share (the TVM engine, tvm.py; the onnxruntime one, ort.py): the LoRA
tensors of a setup, the graphs they compile or run and their cache keys.
"""
from __future__ import annotations

import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from lorac.core import artifact_cache
from lorac.core.keys import digest, versions
from lorac.core.loraplus import AdamWConstants

from ..errors import LoracError


BATCH_INPUTS = ("input_ids", "labels", "position_ids")  # what a batch feeds (position_ids: isolated packing)


def release_host_memory() -> None:
    """Hand the heap memory freed so far back to the OS (glibc's malloc_trim; elsewhere nothing).
    Loading a base allocates and frees many arrays of 1-4 MB (dequantized weights, their
    temporaries); glibc keeps such freed blocks in its heap, so the weights' host copies
    stayed resident after the upload: 330 MB of a dense SmolLM2 CPU run (docs/BENCHMARKS.md,
    QLoRA on the CPU)."""
    import ctypes
    import ctypes.util
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


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
    (inputs bound: compiler/targets/cuda binds_inputs); tune: MetaSchedule trials (compiler/tune.py;
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
        except Exception as e:  # noqa: BLE001  ImportError, or a runtime-only TVM's AttributeError on import
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
        from lorac.graphs.optimizer import buckets
        self._buckets = buckets(self.shapes)  # the optimizer's flat buckets (graphs/optimizer.Bucket)
        self.optim_cfg = optim_cfg
        # what a checkpoint must match: the scan chunk length changes how the Mamba scan is
        # computed, not what, so a run may resume on a device whose default length differs; nor
        # does splitting the batch over `ranks` data-parallel workers (the whole batch's graph)
        same_math = replace(train, extra={k: v for k, v in train.extra.items() if k != "scan_chunk"},
                            batch=train.batch * ranks)
        self.graph_hash = graph_key("train", spec, same_math)
        self.grad_reducer = None  # data parallel: sums the flat gradients over the workers (runtime/dist/__init__.py)

    def _recipe(self, kind: str):
        """(emit function, key parts, dtype) of graph `kind`: "train", "eval", "adamw" or
        "forward:B,S" (the forward graph for ids of shape [B, S]). Every graph but the
        optimizer's takes the LoRA tensors as the optimizer's flat buckets and writes its
        gradients the same way (graphs/flat_lora.py): `<bucket>.param`, `<bucket>.grad`."""
        from lorac.graphs.flat_lora import flat_lora_io
        build, parts, dtype = self._per_tensor_recipe(kind)
        if kind == "adamw":
            return build, parts, dtype
        return (lambda: flat_lora_io(build(), self.shapes)), (*parts, "flat-lora"), dtype

    def _per_tensor_recipe(self, kind: str):
        """_recipe's graphs as lorac.graphs emits them: one input and one gradient per LoRA tensor."""
        from lorac.graphs import build_eval_graph, build_forward_graph, build_training_graph
        from lorac.graphs.optimizer import build_optimizer_graph
        if kind in ("train", "eval"):
            emit = build_training_graph if kind == "train" else build_eval_graph
            return (lambda: emit(self.spec, self.train)), (self.spec, self.train), self.dtype
        if kind == "adamw":  # lr and step are inputs; the graph is built from its key's constants alone
            c = AdamWConstants.of(self.optim_cfg)
            return (lambda: build_optimizer_graph(self.shapes, c)), (self.shapes, c), "float32"
        # generation: one document a row, so the plain causal graph (no position_ids) is exact;
        # the same adapter (and quantized weights) at another shape, no backward (no recompute, one
        # loss chunk)
        b, s = (int(x) for x in kind.split(":")[1].split(","))
        fwd = replace(self.train, batch=b, seq=s, checkpointing=False, keep_layers=0, loss_chunk=0, packing="plain")
        return (lambda: build_forward_graph(self.spec, fwd)), (self.spec, fwd), self.dtype

    @staticmethod
    def _missing_weights(wanted, have) -> None:
        """One error when the model's weights lack an input (other than the batch's, LoRA) a graph takes."""
        missing = [n for n in wanted if n not in have and n not in BATCH_INPUTS and "lora_" not in n]
        if missing:
            raise LoracError(f"model weights lack {len(missing)} tensor(s) the graph needs, e.g. {missing[0]}")

    def _to_host(self, a) -> np.ndarray:
        """A numpy copy of a device tensor (a numpy array as it is)."""
        return a if isinstance(a, np.ndarray) else a.numpy()

    def host(self, tensors: dict) -> dict:
        """Numpy copies of a step's outputs (gradients summed over micro-batches on the host)."""
        return {n: self._to_host(a) for n, a in tensors.items()}

    def _flat(self, tensors: dict, suffix: str) -> dict:
        """{"<bucket><suffix>": flat} from flat buckets as they are, or from per-tensor arrays
        ("<name><suffix-less>" keys, numpy or device) packed on the host."""
        from lorac.graphs.optimizer import pack
        keys = [f"{b.key}{suffix}" for b in self._buckets]
        if all(k in tensors for k in keys):
            return {k: tensors[k] for k in keys}
        plain = "" if suffix == ".param" else suffix  # per tensor: "<name>" and "<name>.grad"
        per = {n: self._to_host(a) for n, a in ((n, tensors.get(n + plain)) for n in self.names) if a is not None}
        if len(per) != len(self.names):
            missing = next(n + plain for n in self.names if n not in per)
            raise LoracError(f"LoRA tensors: {missing} is missing")
        return {f"{k}{suffix}": x for k, x in pack(self._buckets, per).items()}

    # a backend's set_state keeps the LoRA+ AdamW state as flat per-bucket device buffers
    # (graphs/optimizer.Bucket): _buckets, _p, _m, _v (each {bucket key: tensor with .numpy()});
    # its `lora` property is what its step, eval_loss and logits take (the current LoRA tensors)

    def state_numpy(self):
        """(lora, m, v) as per-tensor numpy arrays (checkpoints, export)."""
        from lorac.graphs.optimizer import unpack
        get = lambda flats: {n: a.copy() for n, a in unpack(self._buckets, {k: self._to_host(t) for k, t in flats.items()}).items()}
        return get(self._p), get(self._m), get(self._v)



def _lora_shape(spec, train, name: str) -> tuple[int, int]:
    target = name.split(".lora_")[0].rsplit(".", 1)[1]
    out, inp = spec.proj_shape(target)
    return (train.rank, inp) if ".lora_A." in name else (out, train.rank)
