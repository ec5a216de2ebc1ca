"""lorac.compiler: ONNX training graph -> TVM Relax -> target artifact.

    from lorac.compiler import compile_graph
    art_dir = compile_graph("train.onnx", target="cpu", out_dir="art/", dtype="float32")

See docs/COMPILER.md for the pipeline, GEMM dispatch, targets and artifact layout.
TVM is imported only when a graph is actually compiled (a cached hit needs none).
"""
from .pipeline import FAMILIES, compile_graph, resolve_target

__all__ = ["compile_graph", "resolve_target", "FAMILIES"]
