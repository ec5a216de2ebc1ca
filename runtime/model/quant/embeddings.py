"""Quantized embeddings (`--quantize-embeddings`): a model's input embedding [V, D] and its untied
LM head held quantized, QLoRA's last dense tables (at Llama-3-8B's shape 1.05 GB each in bf16).

Two formats, both read by rows (graphs/ops/quant.py `QuantWeight.rows` for the lookup,
`row_slice` for the head's vocabulary slices in graphs/ops/loss.py):
  nf4   bitsandbytes' NF4, block 64, a plain float32 absmax per block (no double quantization:
        its nested blocks of 256 would cross rows); D must be a multiple of 64. 0.28 bytes a value.
  int8  a scale per vocabulary row (int8.py's per-output-channel rows). 1 byte a value.
Quantized on load by lorac's references (nf4.py, int8.py), after the plan decided (train/plan.py:
explicit values, or auto's choice from the memory estimate); a file's own embeddings are never
replaced, so merged exports merge into the base's dense tables as before.
"""
from __future__ import annotations

import numpy as np

from lorac.core.errors import LoracError
from lorac.graphs.ops.quant import Quant, check_rows, quant_inputs

FLAG = "--quantize-embeddings"
KINDS = {"nf4": Quant("nf4", 64, False), "int8": Quant("int8")}


def tables(spec) -> list[str]:
    """HF names of the model's [V, D] tables: its input embedding, and its LM head where untied."""
    from lorac.graphs.families import for_spec
    names = for_spec(spec).EMBEDDINGS
    return [names[0]] if spec.tied else list(names)


def embedding_quant(spec, kind: str) -> tuple:
    """((name, Quant), ...) of the model's tables held as `kind`; a shape the format cannot read by
    rows is one line naming the flag."""
    q = KINDS[kind]
    for name in tables(spec):
        try:
            check_rows(q, name, spec.vocab, spec.hidden)
        except LoracError as e:
            raise LoracError(f"{FLAG} {kind}: hidden size {spec.hidden} ({e})") from None
    return tuple((name, q) for name in tables(spec))


def held(spec, train, kind: str):
    """`train` (a TrainSpec) with the model's tables held as `kind` in its quant."""
    from dataclasses import replace
    have = dict(train.quant)
    return replace(train, quant=tuple(sorted({**have, **dict(embedding_quant(spec, kind))}.items())))


def table_bytes(spec, quant) -> int:
    """Bytes of the quantized arrays of the tables among `quant` ((name, Quant) pairs)."""
    names = set(tables(spec))
    return sum(int(np.prod(shape)) * np.dtype(dtype).itemsize for name, q in quant if name in names
               for _, shape, dtype in quant_inputs(q, name, spec.vocab, spec.hidden))


def frozen_with(spec, frozen: tuple[int, int], before: tuple, after: tuple) -> tuple[int, int]:
    """train/memory.frozen_sizes of weights loaded with quant `before`, once the tables `after` adds
    are quantized: their dense elements become blocks and scales."""
    added = tuple((n, q) for n, q in after if n in set(tables(spec)) and n not in dict(before))
    return frozen[0] - len(added) * spec.vocab * spec.hidden, frozen[1] + table_bytes(spec, added)


def quantize_tables(weights: dict, quant: tuple) -> dict:
    """`weights` with each dense table that `quant` holds quantized replaced by its arrays (the
    references: nf4.py without double quantization, int8.py per row); the rest as it is."""
    from . import quantize_one
    todo = [(n, q) for n, q in quant if n in weights and np.ndim(weights[n]) == 2]
    if not todo:
        return weights
    out = dict(weights)
    for name, q in todo:
        out.update(quantize_one(out.pop(name), q.kind, name, double=q.double))
    return out


def describe(spec, quant, dtype: str, slices: int = 0) -> str:
    """One line on the tables held quantized: their bytes against the dense ones, the head's slices."""
    from lorac.graphs.ops.loss import head_slices
    have = dict(quant)
    mine = [(n, have[n]) for n in tables(spec) if n in have]
    dense = len(mine) * spec.vocab * spec.hidden * (2 if dtype == "bfloat16" else 4)
    parts = head_slices(spec.vocab, spec.hidden, slices)
    return (f"{' and '.join(n for n, _ in mine)} held as {mine[0][1].kind}: {table_bytes(spec, mine) / 1e9:.2f} GB "
            f"of blocks and scales instead of {dense / 1e9:.2f} GB in {dtype}; lookups dequantize the rows they read, "
            f"the LM head is read in {len(parts)} vocabulary slice{'s' if len(parts) > 1 else ''} of at most "
            f"{parts[0][1] - parts[0][0]} rows")
