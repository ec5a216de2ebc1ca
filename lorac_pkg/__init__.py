"""lorac: graph-compiled LoRA training.

Stages, each its own subpackage: `lorac.graphs` (ONNX training graphs with hand-derived
backward passes), `lorac.compiler` (Apache TVM artifacts), `lorac.runtime` (the small
runtime that trains, checkpoints and exports adapters).
"""

__version__ = "0.1.0"
