"""Engines: the compiled step and its companions (eval, forward, optimizer) on a backend
(TVM artifacts: tvm.py; onnxruntime: ort.py), and the artifact loader (artifact.py)."""
