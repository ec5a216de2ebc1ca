"""lorac.compiler: ONNX -> TVM Relax -> target artifact."""
