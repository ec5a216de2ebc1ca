"""Where a run's base model comes from: an HF directory, a .gguf file, a Hugging Face Hub id
(runtime/model/hub.py), or the bundled default."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import LoracError

@dataclass
class ModelSource:
    path: Path
    name: str  # what adapters record as base_model_name_or_path

    def describe(self) -> str:
        return f"{self.name} ({self.path})"

    def config(self) -> dict:
        """The HF config dict alone (no weights read)."""
        from .weights import model_config
        return model_config(self.path)

    def load(self, quantize: str | None = None, keep_quantized: bool = False):
        """(HF config dict, frozen weights by HF name, Tokenizer). keep_quantized: a quantized
        base's linear projections stay in their blocks (graphs/ops/quant.py names them); quantize:
        "nf4" or "int8" quantizes a dense base's projections on load."""
        from .tokenizer import load_tokenizer
        from .weights import load_model
        config, weights = load_model(self.path, quantize=quantize, keep_quantized=keep_quantized)
        return config, weights, load_tokenizer(self.path)


def resolve_model(path: str | None) -> ModelSource:
    if path is None:
        from .default import default_gguf_path
        return ModelSource(Path(default_gguf_path()), "HuggingFaceTB/SmolLM2-135M-Instruct")
    p = Path(path)
    if p.exists():
        return ModelSource(p, os.path.abspath(p))
    from .hub import is_repo_id, resolve_hub_model
    if is_repo_id(path):
        return ModelSource(resolve_hub_model(path), path.partition(":")[0])
    raise LoracError(f"model not found: {path}")
