"""What a loaded model's tensors must satisfy before a run uses them, whatever file they came
from (HF safetensors: weights.py; GGUF: gguf.py):

- every tensor the config needs is there (`required_tensors`, asked of the model's family);
- no tensor is left over that no part of the model reads: a config.json with fewer layers
  than the weights hold would train a truncated model without a word. Two kinds of extra are
  harmless and pass: `lm_head.weight` of a model with tied embeddings (transformers ties it
  to the embedding on load too) and RoPE's `rotary_emb.inv_freq` buffers of older
  checkpoints, which are recomputed from the config;
- every float value is finite (`check_finite`): one NaN or inf in a frozen weight makes every
  loss NaN, so every step would be skipped and the run would write an untrained adapter.
  Checked with one vectorised pass per tensor (a float32 sum: NaN and inf propagate into it;
  only where it is not finite are the elements looked at, to name the first bad one).
"""
from __future__ import annotations

import re

import numpy as np

from ..errors import LoracError

HARMLESS = re.compile(r"(^|\.)rotary_emb\.inv_freq$")  # RoPE buffers of older HF checkpoints


def required_tensors(config: dict) -> list:
    """The HF tensor names a model of this config must have (asked of its family)."""
    from lorac.graphs.families import for_model_type
    return for_model_type(config.get("model_type")).required_tensors(config)


def check_weights(config, weights, source):
    """Raise a LoracError naming the first tensor the config needs and the weights lack, the
    tensors nothing reads, or the first non-finite value (module doc)."""
    from lorac.graphs.families import model_types
    if config.get("model_type") not in model_types():
        return  # a family lorac does not train: ModelSpec refuses it with its own message
    layers = config.get("num_hidden_layers", 0)
    if not isinstance(layers, int) or isinstance(layers, bool) or not 0 < layers <= len(weights):
        # (each layer holds at least one tensor: a larger count cannot match these weights)
        raise LoracError(f"{source}: config num_hidden_layers={layers!r} does not fit the {len(weights)} tensors "
                         "of the weights (a positive integer expected)")
    from lorac.graphs.ops.quant import detect
    quantized = detect(weights)  # a quantized weight is held under suffixed keys (graphs/ops/quant.py)
    need = required_tensors(config)
    missing = [n for n in need if n not in weights and n not in quantized]
    if missing:
        raise LoracError(f"{source}: tensor {missing[0]} is missing ({len(missing)} missing in all)")
    check_unused(config, weights, set(need) | set(quantized), source)
    check_finite(weights, source)


def check_unused(config, weights, need: set, source) -> None:
    """`need`: the names the model reads; a quantized weight's suffixed keys (`name.nf4`, ...) go with its name."""
    unused = sorted(n for n in weights if n not in need and n.rpartition(".")[0] not in need
                    and n != "lm_head.weight" and not HARMLESS.search(n))
    if not unused:
        return
    layers = {int(m.group(1)) for n in unused for m in [re.search(r"layers\.(\d+)\.", n)] if m}
    hint = (f"; config.json says num_hidden_layers={config.get('num_hidden_layers')}, the weights hold layer "
            f"{max(layers)}" if layers and max(layers) >= config.get("num_hidden_layers", 0) else
            "; the config and the weights do not describe the same model")
    raise LoracError(f"{source}: {len(unused)} tensor(s) that no part of the model reads, e.g. {unused[0]}{hint}")


def check_finite(weights, source) -> None:
    """Refuse the first float tensor holding a NaN or an infinity, naming it and where."""
    for name, w in weights.items():
        w = np.asarray(w)
        if w.dtype.name == "bfloat16":  # ml_dtypes' bf16 (numpy kind "V"): the exponent bits, all ones
            bad = (w.view(np.uint16) & 0x7F80) == 0x7F80
            if bad.any():
                _refuse(name, w.astype(np.float32), source)
            continue
        if w.dtype.kind != "f" or not w.size:
            continue
        with np.errstate(all="ignore"):  # an overflow of finite values is told apart in _refuse
            total = w.sum(dtype=np.float64 if w.dtype == np.float64 else np.float32)
        if not np.isfinite(total):  # one pass: NaN and inf propagate into the sum
            _refuse(name, w, source)


def _refuse(name, w, source) -> None:
    bad = np.flatnonzero(~np.isfinite(w.reshape(-1)))
    if not len(bad):  # finite values whose sum overflowed
        return
    where = tuple(int(i) for i in np.unravel_index(int(bad[0]), w.shape))
    raise LoracError(f"{source}: tensor {name} holds {w.reshape(-1)[bad[0]]} at {list(where)} ({len(bad)} non-finite "
                     "value(s)); the model's weights are damaged, and training on them would skip every step")
