"""The documents of packed rows as cuDNN's ragged (THD) sequences: lengths and offsets from
position_ids, and the device buffers the packed attention's plans read
(runtime/devices/cuda/attention.py).

A batch [B, S] of packed rows (--packing isolated, docs/DATA.md) numbers each document's
tokens 0, 1, 2, ... from its first one; a row's first token always starts a document (one
that began in an earlier row is cut there, as the CPU graph's mask cuts it). Flattened to
B*S tokens, every document is a contiguous run that no row boundary crosses, so cuDNN's
ragged layout takes each as a sequence of its own: sequence n holds tokens
starts[n] .. starts[n] + lengths[n] - 1, and with causal masking inside each sequence every
token attends exactly to the earlier tokens of its document.

A cuDNN plan has a fixed number of sequences (its capacity) and a fixed longest sequence (its
max_seq: the kernels' grid covers capacity x max_seq / tile tiles, whatever the batch holds).
Both come from the run's data, known before any artifact loads (`reserve_documents`): the most
documents a row holds and the longest document. Documents may also be split by length into
groups, each with plans of its own (`bounds`): short documents in plans of a small max_seq,
the few long ones (a row holds at most S // (lo + 1) documents longer than lo) in plans of a
large one, so that fewer empty tiles are launched. A batch with fewer documents than a group
holds fills the rest with empty sequences (length 0) that start at the end of the tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...errors import LoracError

TILE = 64  # a plan's max_seq is rounded up to this (cuDNN's attention tiles are 64 or 128 tokens)
MASKED = -1e30  # the bias before a query's document (graphs/ops/attention.py's masked score)


def document_runs(positions) -> tuple[np.ndarray, np.ndarray]:
    """positions [B, S] (integers) -> (lengths int32 [n], starts int64 [n]) of the batch's n
    documents in token order. A token starts a document where its position is 0 or where its
    row starts; inside a document each position is the one before plus one (anything else has
    no meaning as documents: a LoracError names the first such token)."""
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
    starts = np.flatnonzero(first).astype(np.int64)
    return np.diff(np.r_[starts, flat.size]).astype(np.int32), starts


def document_bias(positions) -> np.ndarray:
    """positions [B, S] -> the additive bias [B, 1, S, S] (float32) of the packed calls built
    with mask "bias": 0 where key j >= i - positions[b, i] (j in query i's document or after
    it: causal masking hides the keys after i), MASKED before. What the CUDA build computes
    on the device (compiler/targets/cuda/attention.py), for checks."""
    pos = np.asarray(positions, np.int64)
    S = pos.shape[1]
    i, j = np.arange(S)[:, None], np.arange(S)[None, :]
    return np.where(j[None] >= i[None] - pos[:, :, None], 0.0, MASKED).astype(np.float32)[:, None]


def split_documents(positions, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """positions [B, S] -> (lengths int32 [capacity], starts int64 [capacity + 1]): the batch's
    documents in token order, then empty sequences; starts[-1] is B*S, so lengths =
    diff(starts). A batch holding more than `capacity` documents is refused."""
    lengths, starts = document_runs(positions)
    B, S = np.asarray(positions).shape
    return _padded(lengths, starts, capacity, B * S, f"this batch of {B} rows")


def _padded(lengths, starts, capacity: int, tokens: int, what: str, kind: str = "") -> tuple[np.ndarray, np.ndarray]:
    if lengths.size > capacity:
        raise LoracError(f"{what} holds {lengths.size} documents{kind}; the packed attention was prepared for at most "
                         f"{capacity} (reserve_documents before the artifact loads)")
    out_len = np.zeros(capacity, np.int32)
    out_len[:lengths.size] = lengths
    out = np.full(capacity + 1, tokens, np.int64)
    out[:starts.size] = starts
    return out_len, out


@dataclass(frozen=True)
class Group:
    """The documents longer than `lo` and at most `hi` tokens long, run by plans of `capacity`
    sequences of at most `max_seq` tokens (hi rounded up to TILE, at most S)."""
    lo: int
    hi: int
    max_seq: int
    capacity: int


def groups_for(B: int, S: int, per_row: int | None, longest: int | None, bounds=()) -> tuple[Group, ...]:
    """The groups of [B, S] rows whose rows hold at most `per_row` documents (None: every token
    one) of at most `longest` tokens (None: S), split at the length `bounds` below longest."""
    per_row = min(per_row or S, S)
    top = min(longest or S, S)
    edges = sorted({int(b) for b in bounds if 0 < int(b) < top}) + [top]
    out, lo = [], 0
    for hi in edges:
        out.append(Group(lo, hi, min(S, -(-hi // TILE) * TILE), B * min(per_row, S // (lo + 1))))
        lo = hi
    return tuple(out)


class Documents:
    """The device buffers the packed calls of one [B, S] shape read, per group: each sequence's
    length (int32 [capacity]) and, per elements-per-token count m (H*Dh for q/o/do/dq, K*Dh for
    k/v/dk/dv, H for the stats), the element offset of each sequence's first token (int64
    [capacity + 1]). `empty(shape, dtype)` allocates a device buffer with copyfrom(numpy) and
    data_ptr()."""

    def __init__(self, B: int, S: int, groups: tuple[Group, ...], empty):
        self.B, self.S, self.groups, self._empty = B, S, tuple(groups), empty
        self.lengths = [empty((g.capacity,), "int32") for g in self.groups]
        self.offsets: list[dict] = [{} for _ in self.groups]
        self._starts: list = [None] * len(self.groups)
        # until a batch comes: one document a row, as long as the first group takes (the plans' warm-up runs)
        n = min(S, self.groups[0].hi)
        self._put([(np.full(B, n, np.int32), np.arange(B, dtype=np.int64) * S)]
                  + [(np.zeros(0, np.int32), np.zeros(0, np.int64))] * (len(self.groups) - 1))

    @property
    def capacity(self) -> int:
        return sum(g.capacity for g in self.groups)

    @property
    def longest(self) -> int:
        return self.groups[-1].hi

    def offsets_of(self, group: int, per_token: int):
        buf = self.offsets[group].get(per_token)
        if buf is None:
            buf = self.offsets[group][per_token] = self._empty((self.groups[group].capacity + 1,), "int64")
            buf.copyfrom(self._starts[group] * per_token)
        return buf

    def fill(self, positions) -> None:
        """Lengths and offsets of the documents of `positions` [B, S] (numpy), each group's
        documents in token order. A batch with more documents than the plans hold, or a
        document longer than the longest they were built for, is refused (the data they were
        sized by cannot make one: reserve_documents)."""
        pos = np.asarray(positions)
        if pos.shape != (self.B, self.S):
            raise LoracError(f"position_ids {list(pos.shape)}: the packed attention runs [{self.B}, {self.S}] rows")
        lengths, starts = document_runs(pos)
        if lengths.size and int(lengths.max()) > self.longest:
            raise LoracError(f"this batch holds a document of {int(lengths.max())} tokens; the packed attention was "
                             f"prepared for documents of at most {self.longest} (reserve_documents before the "
                             "artifact loads)")
        parts = []
        for g in self.groups:
            take = (lengths > g.lo) & (lengths <= g.hi)
            parts.append((lengths[take], starts[take]))
        self._put(parts, f"this batch of {self.B} rows")

    def _put(self, parts, what: str = "") -> None:
        T = self.B * self.S
        for i, (g, (lengths, starts)) in enumerate(zip(self.groups, parts)):
            kind = f" of {g.lo + 1}..{g.hi} tokens" if len(self.groups) > 1 else ""
            lens, st = _padded(lengths, starts, g.capacity, T, what, kind)
            self.lengths[i].copyfrom(lens)
            self._starts[i] = st
            for m, buf in self.offsets[i].items():
                buf.copyfrom(st * m)
