"""The packed dataset (PackedData: a train and an eval TokenStore as [batch, seq] rows,
plain or isolated) and its resumable batch order (BatchIterator)."""
from __future__ import annotations

import weakref

import numpy as np

from ..errors import LoracError
from .store import IGNORE
from .temp import remove_temp

PACKINGS = ("plain", "isolated")  # how documents share a row (the package's doc)


class PackedData:
    """A tokenized, packed dataset: `.train` and `.eval` TokenStores, `.seq`, `.pad_id`.

    Rows in which no label counts (a long prompt filling a whole row, say) would make a step
    that learns nothing and an eval loss of 0: they are left out of both (`train_rows`,
    `eval_rows`: the row numbers used) and counted in describe()."""

    def __init__(self, train, eval_, seq, pad_id, folder, owns_folder, lock=None, packing="plain"):
        if packing not in PACKINGS:
            raise LoracError(f"--packing must be one of {', '.join(PACKINGS)}, got {packing!r}")
        self.train, self.eval, self.seq, self.pad_id = train, eval_, seq, pad_id
        self.packing = packing
        self.folder = folder
        if owns_folder:  # a temporary cache goes when the dataset does (and its lock with it)
            self._cleanup = weakref.finalize(self, remove_temp, folder, lock)
        isolated = packing == "isolated"
        self.train_rows, self.eval_rows = train.answer_rows(seq, isolated), eval_.answer_rows(seq, isolated)

    def batch(self, store, index):
        """Rows `index` of `store` as a batch: {"input_ids", "labels"} int64 [len(index), seq],
        and with isolated packing "position_ids", each document's first label -100."""
        ids, labels = store.rows(index, self.seq, self.pad_id)
        if self.packing != "isolated":
            return {"input_ids": ids, "labels": labels}
        positions = store.positions(index, self.seq)
        labels[positions == 0] = IGNORE
        return {"input_ids": ids, "labels": labels, "position_ids": positions}

    def max_documents(self) -> int:
        """The most documents one used row holds (train and eval; 1 with plain packing, whose
        rows are one sequence each): what CUDA's packed attention is sized for."""
        if self.packing != "isolated":
            return 1
        counts = [store.documents_per_row(rows, self.seq) for store, rows in
                  ((self.train, self.train_rows), (self.eval, self.eval_rows)) if len(rows)]
        return max([1] + [int(c.max()) for c in counts])

    def longest_document(self) -> int:
        """The longest document one used row holds, as position_ids number it (train and eval;
        the row's length with plain packing): what CUDA's packed attention plans are sized for."""
        if self.packing != "isolated":
            return self.seq
        return max([1] + [store.longest_document(rows, self.seq) for store, rows in
                          ((self.train, self.train_rows), (self.eval, self.eval_rows)) if len(rows)])

    @property
    def n_train_rows(self):
        return len(self.train_rows)

    @property
    def digest(self) -> str:
        """Identity of the training stream (what --resume must find again)."""
        return self.train.digest

    def batches(self, batch, seed=0, state=None):
        """An endless, resumable iterator of training batches (see BatchIterator)."""
        return BatchIterator(self, batch, seed, state)

    def eval_batches(self, batch):
        """The eval rows in order, in batches of `batch`; the last is padded with rows that
        count nothing (labels all -100; with isolated packing the first row's positions, so the
        batch holds no more documents, nor longer ones, than the data's rows:
        max_documents, longest_document)."""
        n = len(self.eval_rows)
        for start in range(0, n, batch):
            index = self.eval_rows[start:start + batch]
            b = self.batch(self.eval, index)
            if len(index) < batch:
                fill = batch - len(index)
                filler = {"input_ids": np.full((fill, self.seq), self.pad_id, np.int64),
                          "labels": np.full((fill, self.seq), IGNORE, np.int64)}
                if "position_ids" in b:
                    filler["position_ids"] = np.repeat(b["position_ids"][:1], fill, axis=0)
                b = {k: np.concatenate([v, filler[k]]) for k, v in b.items()}
            yield b

    def describe(self):
        """The counts of both splits (the run's data line and summary.json): documents, tokens
        (padding included), tokens that count in the loss, rows used and left out, and with
        --truncate prompt-left the prompts cut, the tokens cut from them and the padding."""
        out = {}
        for name, store, used in (("train", self.train, self.train_rows), ("eval", self.eval, self.eval_rows)):
            fit = store.fit
            out.update({f"{name}_docs": store.n_docs, f"{name}_tokens": store.n_tokens,
                        f"{name}_counted": store.n_counted, f"{name}_rows": len(used),
                        f"{name}_rows_without_answer": store.n_rows(self.seq) - len(used),
                        f"{name}_prompts_cut": fit.docs_cut if fit else 0,
                        f"{name}_prompt_tokens_cut": fit.tokens_cut if fit else 0,
                        f"{name}_pad_tokens": store.n_pad})
        return out | {"seq": self.seq, "packing": self.packing, "truncate": "prompt-left" if self.train.fit else "none"}


class BatchIterator:
    """Yields {"input_ids", "labels"} (and "position_ids" with isolated packing) int64
    [batch, seq] forever, epoch after epoch.

    Position k of the endless stream is row perm_e[i] with e = epoch, i = index; a batch
    that runs past an epoch's end continues with the next epoch's permutation. `state()`
    is a small JSON-able dict; passing it back resumes the exact sequence.
    """

    def __init__(self, data, batch, seed=0, state=None):
        self.data, self.batch = data, int(batch)
        self.n = data.n_train_rows
        state = state or {"epoch": 0, "index": 0, "seed": int(seed)}
        self.epoch, self.index, self.seed = int(state["epoch"]), int(state["index"]), int(state["seed"])
        if self.index > self.n:
            raise LoracError(f"data position {self.index} is past this dataset's {self.n} rows "
                             "(checkpoint from another dataset or sequence length?)")
        self._perm_epoch, self._perm = None, None

    def state(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed}

    def _permutation(self):
        if self._perm_epoch != self.epoch:
            self._perm = np.random.default_rng([self.seed, self.epoch]).permutation(self.n)
            self._perm_epoch = self.epoch
        return self._perm

    def __iter__(self):
        return self

    def __next__(self):
        rows = []
        while len(rows) < self.batch:
            take = self._permutation()[self.index:self.index + self.batch - len(rows)]
            rows.extend(take.tolist())
            self.index += len(take)
            if self.index >= self.n:
                self.epoch, self.index = self.epoch + 1, 0
        return self.data.batch(self.data.train, self.data.train_rows[rows])
