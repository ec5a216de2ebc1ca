"""Hugging Face checkpoints quantized by bitsandbytes to 4-bit NF4 (the `*-bnb-4bit`
repositories): config.json's `quantization_config` says so, and each quantized linear
weight `W` is stored as `W` (uint8 [n/2, 1]) beside `W.absmax`, `W.quant_map`, (double
quantization) `W.nested_absmax`, `W.nested_quant_map`, and `W.quant_state.bitsandbytes__nf4`
(a JSON quant state in a uint8 tensor). nf4.from_bnb reads one such weight.
"""
from __future__ import annotations

from lorac.core.dtypes import as_dtype
from lorac.core.errors import LoracError

from . import nf4

STATE = ".quant_state.bitsandbytes__"
AUX = (".absmax", ".quant_map", ".nested_absmax", ".nested_quant_map")


def is_bnb(config: dict, source) -> bool:
    """Whether config.json declares a bitsandbytes 4-bit NF4 checkpoint; a LoracError naming
    the field for any other quantization lorac cannot read."""
    qc = config.get("quantization_config")
    if qc is None:
        return False
    if not isinstance(qc, dict):
        raise LoracError(f"{source}: config.json quantization_config is not an object")
    method = qc.get("quant_method", "bitsandbytes")
    if method != "bitsandbytes":
        raise LoracError(f"{source}: quantization_config.quant_method={method!r} is not supported "
                         "(lorac reads bitsandbytes 4-bit nf4 checkpoints, GGUF files, or dense weights)")
    if qc.get("load_in_8bit"):
        raise LoracError(f"{source}: quantization_config.load_in_8bit: 8-bit bitsandbytes checkpoints are not "
                         "supported (4-bit nf4 is; or pass a dense model with --quantize int8)")
    if not qc.get("load_in_4bit"):
        raise LoracError(f"{source}: quantization_config.load_in_4bit is not true (only 4-bit nf4 bitsandbytes "
                         "checkpoints are supported)")
    qtype = qc.get("bnb_4bit_quant_type", "fp4")  # transformers' default
    if qtype != "nf4":
        raise LoracError(f"{source}: quantization_config.bnb_4bit_quant_type={qtype!r} is not supported (only nf4)")
    storage = qc.get("bnb_4bit_quant_storage", "uint8")
    if storage != "uint8":
        raise LoracError(f"{source}: quantization_config.bnb_4bit_quant_storage={storage!r} is not supported "
                         "(only uint8)")
    return True


def quantized_names(names) -> dict[str, str]:
    """{weight name: its quant-state key} of every bnb-quantized weight among tensor names."""
    return {n[:n.index(STATE)]: n for n in names if STATE in n}


def aux_names(stem: str, names) -> list[str]:
    """The tensors bnb stores for quantized weight `stem` (itself included), among `names`."""
    return [n for n in names if n == stem or n.startswith(stem + STATE) or n in {stem + a for a in AUX}]


def convert(tensors: dict, dtype, keep: set, source) -> dict:
    """Loaded tensors (bnb's aux tensors in float32, the rest in dtype) -> weights: each
    quantized weight in `keep` as nf4 arrays, the others dequantized to dtype."""
    stems = quantized_names(tensors)
    out = {}
    taken = set()
    for stem in stems:
        mine = aux_names(stem, tensors)
        taken.update(mine)
        arrays, (rows, cols) = nf4.from_bnb({n: tensors[n] for n in mine}, stem)
        if stem in keep:
            out.update({f"{stem}.{k}": v for k, v in arrays.items()})
        else:
            out[stem] = nf4.dequantize(arrays, rows, cols).astype(as_dtype(dtype), copy=False)
    stray = [n for n in tensors if n not in taken and n.endswith(AUX)]
    if stray:
        raise LoracError(f"{source}: tensor {stray[0]} is bitsandbytes state of no quantized weight "
                         f"(its {STATE.strip('.')}nf4 tensor is missing)")
    out.update({n: v for n, v in tensors.items() if n not in taken})
    return out


def float32_names(names) -> set:
    """Names to read as float32 rather than the model dtype: every quantized weight's state."""
    return {n for stem in quantized_names(names) for n in aux_names(stem, names)}

