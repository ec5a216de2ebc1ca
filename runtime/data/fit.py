"""`--truncate prompt-left`: each example trained whole in one row, its prompt cut from the left
where the example is longer than a row.

Without it (`--truncate none`, the default) documents are concatenated into one stream and
cut into rows of --seq tokens wherever the row ends fall (module doc of data/__init__.py):
an example longer than a row spreads over several, the rows holding only its prompt are left
out (no label in them is a target), and its answer is trained on the part of its prompt that
shares its row. Short examples straddle row ends too, and the answer's part in the next row
sees none of its prompt.

With prompt-left, before a document goes into the stream:
- a document longer than --seq loses the start of its prompt (the tokens before its first
  counted token, a leading BOS kept) until it fits; where its answers alone are longer than
  a row the whole prompt goes and the rest spreads over rows as before. This is TRL's
  truncation_mode="keep_end" applied to the prompt only: the answer is never cut.
- a document that fits in a row but would cross the current row's end starts the next row
  instead; the rest of the row is padding (EOS ids, labels -100, a document of its own for
  isolated packing), as TRL's packing does when it never splits a sequence. Documents stay
  in file order (the next that fits, not the best fit), so padding costs up to one document
  a row; the data line tells how much.
"""
from __future__ import annotations

import numpy as np

from ..errors import LoracError

TRUNCATIONS = ("none", "prompt-left")


def check_truncation(truncate: str) -> None:
    if truncate not in TRUNCATIONS:
        raise LoracError(f"--truncate must be one of {', '.join(TRUNCATIONS)}, got {truncate!r}")


class PromptLeft:
    """One split's fitting (the counts: `docs_cut`, `tokens_cut`; its store counts `n_pad`)."""

    def __init__(self, seq: int, bos_id: int | None):
        self.seq, self.bos_id = int(seq), bos_id
        self.docs_cut = self.tokens_cut = 0

    def place(self, store, ids: np.ndarray, mask: np.ndarray):
        """A new document's (ids, mask), cut to fit a row where it is longer; pads `store` to the
        next row first where the document fits a row but not the rest of the current one."""
        seq, n = self.seq, len(ids)
        if n > seq:
            counted = np.flatnonzero(mask)
            first = int(counted[0]) if len(counted) else n
            head = int(n > 0 and self.bos_id is not None and int(ids[0]) == self.bos_id and not mask[0])
            cut = min(n - seq, first - head)
            if cut > 0:
                ids = np.concatenate([ids[:head], ids[head + cut:]])
                mask = np.concatenate([mask[:head], mask[head + cut:]])
                self.docs_cut += 1
                self.tokens_cut += cut
        used = store.n_tokens % seq
        if len(ids) <= seq and used and used + len(ids) > seq:
            store.pad(seq - used)
        return ids, mask
