"""What a loaded model's tensors must satisfy before a run uses them, whatever file they came
from (HF safetensors: weights.py; GGUF: gguf.py)."""
from __future__ import annotations

from ..errors import LoracError


def required_tensors(config: dict) -> list:
    """The HF tensor names a model of this config must have (asked of its family)."""
    from lorac.graphs.families import for_model_type
    return for_model_type(config.get("model_type")).required_tensors(config)


def check_weights(config, weights, source):
    """Raise a LoracError naming the first tensor the config needs and the weights lack."""
    from lorac.graphs.families import model_types
    if config.get("model_type") not in model_types():
        return  # a family lorac does not train: ModelSpec refuses it with its own message
    layers = config.get("num_hidden_layers", 0)
    if not isinstance(layers, int) or isinstance(layers, bool) or not 0 < layers <= len(weights):
        # (each layer holds at least one tensor: a larger count cannot match these weights)
        raise LoracError(f"{source}: config num_hidden_layers={layers!r} does not fit the {len(weights)} tensors "
                         "of the weights (a positive integer expected)")
    from lorac.graphs.quant import detect
    quantized = detect(weights)  # a quantized weight is held under suffixed keys (graphs/quant.py)
    missing = [n for n in required_tensors(config) if n not in weights and n not in quantized]
    if missing:
        raise LoracError(f"{source}: tensor {missing[0]} is missing ({len(missing)} missing in all)")
