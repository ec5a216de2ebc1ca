"""A split's token stream on disk: flat files appended while tokenizing, memory-mapped
once closed, read back as [rows, seq] input ids and labels (and position ids)."""
from __future__ import annotations

import hashlib
import math
import os

import numpy as np

IGNORE = -100           # HF's label for "no loss here"


class TokenStore:
    """A split's token stream in two flat files (ids int32, mask uint8), appended while
    tokenizing (buffered: one write per FLUSH_TOKENS), memory-mapped once `close()`d."""

    FLUSH_TOKENS = 1 << 17

    def __init__(self, folder, name, fit=None, pad_id=0):
        self.ids_path = os.path.join(folder, f"{name}.ids.i32")
        self.mask_path = os.path.join(folder, f"{name}.mask.u8")
        self.starts_path = os.path.join(folder, f"{name}.starts.i64")  # offset of each document's first token
        self._ids = open(self.ids_path, "wb")
        self._mask = open(self.mask_path, "wb")
        self._starts = open(self.starts_path, "wb")
        self.n_tokens = self.n_counted = self.n_docs = self.n_pad = 0
        self.fit, self.pad_id = fit, pad_id  # fit: --truncate prompt-left (fit.py), or None
        self.ids = self.mask = self.starts = None
        self._buf, self._buffered, self._buf_starts = [], 0, []
        self._sha_ids, self._sha_mask, self._sha_starts = hashlib.sha256(), hashlib.sha256(), hashlib.sha256()

    def append(self, ids, mask, new_doc=True):
        """A document's tokens, or with new_doc=False the next piece of the last one."""
        assert ids.dtype == np.int32 and mask.dtype == np.uint8, "the files hold int32 ids, uint8 mask"
        start = new_doc or self.n_docs == 0
        if start and self.fit is not None:
            ids, mask = self.fit.place(self, ids, mask)
        self.n_docs += start
        self._write(ids, mask, start)

    def pad(self, n):
        """n padding tokens (EOS ids that count nothing), a document of their own that n_docs
        does not count: the rest of a row that the next document does not fit (fit.py)."""
        self.n_pad += n
        self._write(np.full(n, self.pad_id, np.int32), np.zeros(n, np.uint8), True)

    def _write(self, ids, mask, start):
        if start:
            self._buf_starts.append(self.n_tokens)
        self._buf.append((ids, mask))
        self._buffered += len(ids)
        self.n_tokens += len(ids)
        self.n_counted += int(mask.sum())
        if self._buffered >= self.FLUSH_TOKENS:
            self._flush()

    def _flush(self):
        if self._buf:
            ids, mask = np.concatenate([i for i, _ in self._buf]), np.concatenate([m for _, m in self._buf])
            starts = np.asarray(self._buf_starts, np.int64)
            ids.tofile(self._ids)
            mask.tofile(self._mask)
            starts.tofile(self._starts)
            self._sha_ids.update(ids)  # the arrays' own buffers: no copies
            self._sha_mask.update(mask)
            self._sha_starts.update(starts)
        self._buf, self._buffered, self._buf_starts = [], 0, []

    def close(self):
        if self._ids.closed:
            return
        self._flush()
        for f in (self._ids, self._mask, self._starts):
            f.close()
        if self.n_tokens:
            self.ids = np.memmap(self.ids_path, dtype=np.int32, mode="r")
            self.mask = np.memmap(self.mask_path, dtype=np.uint8, mode="r")
            self.starts = np.memmap(self.starts_path, dtype=np.int64, mode="r")
        else:
            self.ids, self.mask, self.starts = np.zeros(0, np.int32), np.zeros(0, np.uint8), np.zeros(0, np.int64)

    def n_rows(self, seq):
        return math.ceil(self.n_tokens / seq)

    @property
    def digest(self) -> str:
        """sha256 of the stream (its ids, its mask and where its documents start), known once closed."""
        return hashlib.sha256(self._sha_ids.digest() + self._sha_mask.digest() + self._sha_starts.digest()).hexdigest()

    def answer_rows(self, seq, isolated=False):
        """Numbers of the rows with at least one label the loss sees: the graph predicts token
        t+1 from t, so a counted token in a row's first position is never a target (nor, with
        isolated documents, one at a document's start). Read in blocks of rows from the
        memory-mapped mask."""
        n_rows, found = self.n_rows(seq), []
        block = max(1, (1 << 20) // seq)
        for a in range(0, n_rows, block):
            b = min(n_rows, a + block)
            rows = np.zeros((b - a) * seq, np.uint8)
            part = np.asarray(self.mask[a * seq:b * seq])
            rows[:len(part)] = part  # the last row's padding counts nothing
            rows = rows.reshape(b - a, seq)
            if isolated:
                rows[self.positions(np.arange(a, b), seq) == 0] = 0
            found.append(a + np.flatnonzero(rows[:, 1:].max(axis=1)))  # max: no bool copy of the block
        return np.concatenate(found).astype(np.int64) if found else np.zeros(0, np.int64)

    def positions(self, index, seq):
        """Rows `index` -> position ids, int64 [len(index), seq]: each token's offset from the
        start of its document or of the row, whichever is later (a row that starts inside a
        document sees only that part of it); the last row's padding is a document of its own."""
        index = np.asarray(index, np.int64)
        if len(index) == 0:
            return np.zeros((0, seq), np.int64)
        first = np.zeros((len(index), seq), bool)
        first[:, 0] = True
        for k, r in enumerate(index.tolist()):
            a, b = r * seq, (r + 1) * seq
            lo, hi = np.searchsorted(self.starts, [a, b])  # the documents starting in [a, b)
            first[k, np.asarray(self.starts[lo:hi]) - a] = True
            if a < self.n_tokens < b:
                first[k, self.n_tokens - a] = True
        col = np.arange(seq, dtype=np.int64)
        return col - np.maximum.accumulate(np.where(first, col, 0), axis=1)

    def documents_per_row(self, index, seq):
        """Rows `index` -> how many documents each holds as positions() numbers them (the
        tokens with position 0): one from the row's start, one more for each document
        starting after it, and the last row's padding as one of its own."""
        a = np.asarray(index, np.int64) * seq
        b = a + seq
        inside = np.searchsorted(self.starts, b) - np.searchsorted(self.starts, a, side="right")
        return 1 + inside + ((a < self.n_tokens) & (self.n_tokens < b))

    def longest_document(self, index, seq):
        """Rows `index` -> the longest document any of them holds as positions() numbers them
        (a document cut by a row's start or end counts the part inside the row; the last
        row's padding is one of its own), 0 for no rows."""
        index = np.asarray(index, np.int64)
        if index.size == 0:
            return 0
        n_rows = self.n_rows(seq)
        cuts = np.unique(np.concatenate([np.asarray(self.starts, np.int64), np.arange(n_rows + 1, dtype=np.int64) * seq,
                                         [self.n_tokens]]))
        lengths, row = np.diff(cuts), cuts[:-1] // seq
        longest = np.zeros(n_rows, np.int64)
        np.maximum.at(longest, row, lengths)
        return int(longest[index].max())

    def rows(self, index, seq, pad_id):
        """Rows `index` (array of row numbers) -> (input_ids, labels), int64 [len(index), seq]."""
        ids = np.full((len(index), seq), pad_id, dtype=np.int64)
        labels = np.full((len(index), seq), IGNORE, dtype=np.int64)
        for k, r in enumerate(index):
            a, b = int(r) * seq, min((int(r) + 1) * seq, self.n_tokens)
            ids[k, :b - a] = self.ids[a:b]
            labels[k, :b - a] = np.where(self.mask[a:b] > 0, self.ids[a:b], IGNORE)
        return ids, labels
