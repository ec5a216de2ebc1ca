"""Engines: the compiled step and its companions (eval, forward, optimizer) on a backend
(TVM artifacts: tvm.py; onnxruntime: ort.py), and the artifact loader (artifact.py)."""

from __future__ import annotations

from ..errors import LoracError


def make_engine(backend: str, spec, train, weights: dict, target: str = "cpu", dtype: str | None = None,
                cache_dir=".lorac-cache", optim_cfg=None, log=None, cuda_graph: bool = True, providers=None,
                ranks: int = 1, tune: int = 0, host_tables: tuple = ()):
    """The engine of `backend`: "tvm" (compiled artifacts) or "ort" (onnxruntime, `providers`);
    `ranks` data-parallel workers (runtime/dist/__init__.py), `tune` MetaSchedule trials and
    `host_tables` (tables read from host memory: --offload-embeddings) on the TVM backend."""
    if backend == "ort":
        if ranks > 1:
            raise LoracError("data-parallel training (--gpus, mpiexec) runs on --backend tvm")
        from .ort import OrtEngine
        return OrtEngine(spec, train, weights, target, dtype, cache_dir, optim_cfg, log, providers=providers)
    if providers:
        raise LoracError("--ort-providers is for --backend ort")
    from .tvm import Engine
    return Engine(spec, train, weights, target, dtype, cache_dir, optim_cfg, log, cuda_graph=cuda_graph, ranks=ranks,
                  tune=tune, host_tables=host_tables)
