"""Packed documents as cuDNN's ragged sequences, without a GPU (runtime/devices/cuda/documents.py
and the buffers of runtime/devices/cuda/attention.py): the lengths and offsets computed from
position_ids, and that a causal mask inside each of those sequences is exactly the packed
graph's mask (graphs/ops/attention.py: query i at position p sees keys i - p .. i)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from lorac.runtime.devices.cuda import attention
from lorac.runtime.devices.cuda.documents import split_documents
from lorac.runtime.errors import LoracError


def positions_of(*lengths: int) -> np.ndarray:
    return np.concatenate([np.arange(n) for n in lengths]).astype(np.int64)


def rows(*docs) -> np.ndarray:
    return np.stack([positions_of(*d) for d in docs])


def graph_mask(pos: np.ndarray) -> np.ndarray:
    """[B, S, S]: the packed unit's mask, key j seen by query i where i - pos[i] <= j <= i."""
    S = pos.shape[1]
    i, j = np.arange(S)[:, None], np.arange(S)[None, :]
    return (j <= i) & (i - j <= pos[:, :, None])


def ragged_mask(lengths: np.ndarray, starts: np.ndarray, B: int, S: int) -> np.ndarray:
    """[B, S, S]: causal attention inside each ragged sequence, over the flattened tokens."""
    seen = np.zeros((B * S, B * S), bool)
    for a, n in zip(starts[:-1].tolist(), lengths.tolist()):
        seen[a:a + n, a:a + n] = np.tril(np.ones((n, n), bool))
    blocks = seen.reshape(B, S, B, S)
    off = blocks.copy()
    off[np.arange(B), :, np.arange(B), :] = False
    assert not off.any(), "a sequence crosses a row boundary"
    return blocks[np.arange(B), :, np.arange(B), :]


CASES = [  # rows of documents (lengths), [B, S] each
    [(2, 3)],
    [(3, 4), (1, 2, 1, 3)],  # a document of length 1
    [(9,), (4, 5)],  # a row that is one document
    [(1, 1, 1, 1, 1, 1)],  # every token a document
    [(1, 7), (7, 1), (8,)],  # length-1 documents first and last
]


@pytest.mark.parametrize("docs", CASES)
def test_lengths_and_starts_follow_the_documents(docs):
    pos = rows(*docs)
    B, S = pos.shape
    n = sum(len(d) for d in docs)
    for capacity in (n, n + 3, B * S):
        lengths, starts = split_documents(pos, capacity)
        assert lengths.dtype == np.int32 and starts.dtype == np.int64
        assert lengths.shape == (capacity,) and starts.shape == (capacity + 1,)
        want = [x for d in docs for x in d]
        assert lengths[:n].tolist() == want and not lengths[n:].any()  # then empty sequences
        assert starts[0] == 0 and (starts[n:] == B * S).all()  # the empty ones start at the end
        np.testing.assert_array_equal(np.diff(starts), lengths)
        np.testing.assert_array_equal(ragged_mask(lengths, starts, B, S), graph_mask(pos))


def test_random_rows_equal_the_graph_mask():
    """Rows of 4..40 documents of random lengths (length 1 included), as the H200 check draws them."""
    rng = np.random.default_rng(0)
    B, S = 6, 96
    pos = []
    for _ in range(B):
        cuts = np.sort(rng.choice(np.arange(1, S), rng.integers(3, 40), replace=False))
        pos.append(np.concatenate([np.arange(n) for n in np.diff(np.r_[0, cuts, S])]))
    pos = np.stack(pos)
    n = int((pos == 0).sum())
    lengths, starts = split_documents(pos, n + 5)
    assert lengths[:n].min() >= 1 and (lengths[:n] == 1).any()
    np.testing.assert_array_equal(ragged_mask(lengths, starts, B, S), graph_mask(pos))
    assert split_documents(pos.astype(np.int32), n)[0].tolist() == lengths[:n].tolist()


def test_a_row_starting_inside_a_document():
    """A row whose first position is not 0 (its document began in an earlier row): the graph's
    mask sees the row from its start, and so does the ragged sequence."""
    pos = np.array([[5, 6, 7, 0, 1], [0, 1, 2, 3, 0]])
    lengths, starts = split_documents(pos, 4)
    assert lengths.tolist() == [3, 2, 4, 1] and starts.tolist() == [0, 3, 5, 9, 10]
    np.testing.assert_array_equal(ragged_mask(lengths, starts, 2, 5), graph_mask(pos))


def test_refusals():
    pos = rows((2, 3), (5,))
    with pytest.raises(LoracError, match="holds 3 documents; the packed attention was prepared for at most 2"):
        split_documents(pos, 2)
    with pytest.raises(LoracError, match=r"row 1: position 3 at token 2 follows 1"):
        split_documents(np.array([[0, 1, 2], [0, 1, 3]]), 4)
    with pytest.raises(LoracError, match="integers"):
        split_documents(pos.astype(np.float32), 4)
    with pytest.raises(LoracError, match=r"\[batch, seq\]"):
        split_documents(pos[0], 4)


class _Buffer:
    """A host stand-in for a device buffer: copyfrom(numpy) and data_ptr()."""

    def __init__(self, shape, dtype):
        self.a = np.full(shape, -7, dtype)

    def copyfrom(self, x):
        assert x.shape == self.a.shape and x.dtype == self.a.dtype
        self.a[...] = x

    def data_ptr(self):
        return self.a.ctypes.data


@pytest.fixture
def clean():
    attention.release()
    yield
    attention.release()
    attention._per_row[0] = None


def test_document_buffers_and_the_feeder(clean):
    """The buffers the packed plans read: capacity B x the reserved documents a row (every
    token when none was reserved), lengths and the offsets in each layout's elements per
    token, filled from each call's position_ids by the feeder the artifact's Step calls."""
    B, S, H, K, Dh = 2, 9, 4, 2, 8
    docs = attention.documents_for(B, S, _Buffer)
    assert docs.capacity == B * S  # nothing reserved: every token may be a document
    attention.release()
    attention.reserve_documents(4)
    docs = attention.documents_for(B, S, _Buffer)
    assert docs.capacity == 8 and attention.documents_for(B, S, _Buffer) is docs
    assert docs.lengths.a.tolist() == [9, 9] + [0] * 6  # one document a row until a batch comes
    q, kv, lse = (docs.offsets_of(m) for m in (H * Dh, K * Dh, H))
    manifest = SimpleNamespace(unit_calls=[
        {"function": attention.PACKED_FWD, "B": B, "S": S, "H": H, "K": K, "Dh": Dh, "scale": 0.3},
        {"function": attention.FWD, "B": 1, "S": 4, "H": H, "K": K, "Dh": Dh, "scale": 0.3}])
    feed = attention.feeder(manifest)
    pos = rows((3, 4, 2), (1, 8))
    feed({"position_ids": pos, "input_ids": np.zeros((B, S), np.int64)})
    lengths, starts = split_documents(pos, 8)
    assert docs.lengths.a.tolist() == lengths.tolist() == [3, 4, 2, 1, 8, 0, 0, 0]
    for buf, m in ((q, H * Dh), (kv, K * Dh), (lse, H)):
        np.testing.assert_array_equal(buf.a, starts * m)
    late = docs.offsets_of(3)  # made after a fill: filled with that batch's documents at once
    np.testing.assert_array_equal(late.a, starts * 3)
    with pytest.raises(LoracError, match="at most 8"):
        feed({"position_ids": np.broadcast_to(np.zeros(S, np.int64), (B, S))})
    with pytest.raises(LoracError, match="runs \\[2, 9\\] rows"):
        feed({"position_ids": pos[:1]})
    with pytest.raises(LoracError, match="needs the input position_ids"):
        feed({})
    assert attention.feeder(SimpleNamespace(unit_calls=manifest.unit_calls[1:])) is None  # plain calls only
