"""lorac.graphs: model specs and ONNX training-graph emitters."""
