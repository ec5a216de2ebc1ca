"""The documents of packed rows as cuDNN's ragged (THD) sequences: lengths and offsets from
position_ids (numpy only; the packed attention's device buffers are filled from these,
runtime/devices/cuda/attention.py).

A batch [B, S] of packed rows (--packing isolated, docs/DATA.md) numbers each document's
tokens 0, 1, 2, ... from its first one; a row's first token always starts a document (one
that began in an earlier row is cut there, as the CPU graph's mask cuts it). Flattened to
B*S tokens, every document is a contiguous run that no row boundary crosses, so cuDNN's
ragged layout takes each as a sequence of its own: sequence n holds tokens
starts[n] .. starts[n] + lengths[n] - 1, and with causal masking inside each sequence every
token attends exactly to the earlier tokens of its document. cuDNN's plans have a fixed
number of sequences (`capacity`); a batch with fewer documents fills the rest with empty
sequences (length 0) that start at the end of the tokens.
"""
from __future__ import annotations

import numpy as np

from ...errors import LoracError


def split_documents(positions, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """positions [B, S] (integers) -> (lengths int32 [capacity], starts int64 [capacity + 1]):
    the batch's documents in token order, then empty sequences; starts[-1] is B*S, so
    lengths = diff(starts). A token starts a document where its position is 0 or where its
    row starts; inside a document each position is the one before plus one (anything else
    has no meaning as documents: a LoracError names the first such token), and a batch
    holding more than `capacity` documents is refused."""
    pos = np.asarray(positions)
    if pos.ndim != 2 or pos.dtype.kind not in "iu":
        raise LoracError(f"position_ids must be integers [batch, seq], got {pos.dtype} {list(pos.shape)}")
    B, S = pos.shape
    flat = pos.reshape(-1).astype(np.int64)
    row_start = np.arange(flat.size) % S == 0 if S else np.zeros(0, bool)
    first = row_start | (flat == 0)
    follows = np.empty_like(flat)
    follows[:1] = -1
    follows[1:] = flat[:-1] + 1
    bad = np.flatnonzero(~first & (flat != follows))
    if bad.size:
        i = int(bad[0])
        raise LoracError(f"position_ids row {i // S}: position {int(flat[i])} at token {i % S} follows "
                         f"{int(flat[i - 1])}; each document's tokens must be numbered 0, 1, 2, ... from its first")
    starts = np.flatnonzero(first)
    if starts.size > capacity:
        raise LoracError(f"this batch of {B} rows holds {starts.size} documents; the packed attention was "
                         f"prepared for at most {capacity} (reserve_documents before the artifact loads)")
    out = np.full(capacity + 1, flat.size, np.int64)
    out[:starts.size] = starts
    return np.diff(out).astype(np.int32), out
