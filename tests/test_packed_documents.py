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


def _random_rows(rng, B: int, S: int, lo: int, hi: int) -> np.ndarray:
    """position_ids [B, S] of rows cut at lo..hi-1 random places each (documents of random lengths,
    length 1 included), positions restarting at every document."""
    pos = []
    for _ in range(B):
        cuts = np.sort(rng.choice(np.arange(1, S), rng.integers(lo, hi), replace=False))
        pos.append(np.concatenate([np.arange(n) for n in np.diff(np.r_[0, cuts, S])]))
    return np.stack(pos)


def test_random_rows_equal_the_graph_mask():
    """Rows of 4..40 documents of random lengths (length 1 included), as the H200 check draws them."""
    B, S = 6, 96
    pos = _random_rows(np.random.default_rng(0), B, S, 3, 40)
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
    """A host stand-in for a device buffer: copyfrom(numpy) and data_ptr() (bf16 as its bits)."""

    def __init__(self, shape, dtype):
        fill = {"bfloat16": 0x7FC0, "uint8": 7}.get(dtype, -7)  # bf16: NaN; anything a write would change
        self.a = np.full(shape, fill, np.uint16 if dtype == "bfloat16" else dtype)

    def copyfrom(self, x):
        assert x.shape == self.a.shape and x.dtype == self.a.dtype
        self.a[...] = x

    def data_ptr(self):
        return self.a.ctypes.data


@pytest.fixture
def clean():
    attention.release()
    saved = dict(attention.PACKED)
    yield
    attention.release()
    attention._reserved.update(per_row=None, longest=None)
    attention.PACKED.update(saved)


def test_document_buffers_and_the_feeder(clean):
    """The buffers the packed plans read: capacity B x the reserved documents a row (every
    token when none was reserved), lengths and the offsets in each layout's elements per
    token, filled from each call's position_ids by the feeder the artifact's Step calls."""
    B, S, H, K, Dh = 2, 9, 4, 2, 8
    docs = attention.documents_for(B, S, _Buffer)
    assert docs.capacity == B * S and docs.longest == S  # nothing reserved: every token may be a document
    attention.release()
    attention.reserve_documents(4)
    docs = attention.documents_for(B, S, _Buffer)
    assert docs.capacity == 8 and attention.documents_for(B, S, _Buffer) is docs
    assert docs.lengths[0].a.tolist() == [9, 9] + [0] * 6  # one document a row until a batch comes
    q, kv, lse = (docs.offsets_of(0, m) for m in (H * Dh, K * Dh, H))
    manifest = SimpleNamespace(unit_calls=[
        {"function": attention.PACKED_FWD, "B": B, "S": S, "H": H, "K": K, "Dh": Dh, "scale": 0.3},
        {"function": attention.FWD, "B": 1, "S": 4, "H": H, "K": K, "Dh": Dh, "scale": 0.3}])
    feed = attention.feeder(manifest)
    pos = rows((3, 4, 2), (1, 8))
    feed({"position_ids": pos, "input_ids": np.zeros((B, S), np.int64)})
    lengths, starts = split_documents(pos, 8)
    assert docs.lengths[0].a.tolist() == lengths.tolist() == [3, 4, 2, 1, 8, 0, 0, 0]
    for buf, m in ((q, H * Dh), (kv, K * Dh), (lse, H)):
        np.testing.assert_array_equal(buf.a, starts * m)
    late = docs.offsets_of(0, 3)  # made after a fill: filled with that batch's documents at once
    np.testing.assert_array_equal(late.a, starts * 3)
    with pytest.raises(LoracError, match="at most 8"):
        feed({"position_ids": np.broadcast_to(np.zeros(S, np.int64), (B, S))})
    with pytest.raises(LoracError, match="runs \\[2, 9\\] rows"):
        feed({"position_ids": pos[:1]})
    with pytest.raises(LoracError, match="needs the input position_ids"):
        feed({})
    assert attention.feeder(SimpleNamespace(unit_calls=manifest.unit_calls[1:])) is None  # plain calls only


# -- the plans, on an emulator of cuDNN's frontend (tests/_cudnn_emulator.py) ------------------------
def bf16(x: np.ndarray) -> np.ndarray:
    """float -> bf16 bits (round to nearest even)."""
    u = np.asarray(x, np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def f64(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def reference(q, k, v, do, seen, scale):
    """Attention of [B, S, heads, D] float64 values under mask `seen` [B, S, S] and its gradients."""
    G = q.shape[2] // k.shape[2]
    kk, vv = np.repeat(k, G, axis=2), np.repeat(v, G, axis=2)
    s = np.where(seen[:, None], np.einsum("bihd,bjhd->bhij", q, kk) * scale, -np.inf)
    lse = np.log(np.exp(s - s.max(-1, keepdims=True)).sum(-1, keepdims=True)) + s.max(-1, keepdims=True)
    p = np.exp(s - lse)
    o = np.einsum("bhij,bjhd->bihd", p, vv)
    dp = np.einsum("bihd,bjhd->bhij", do, vv)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True)) * scale
    fold = lambda x: x.reshape(*x.shape[:2], k.shape[2], G, x.shape[-1]).sum(3)  # noqa: E731
    return {"o": o, "lse": lse[..., 0].transpose(0, 2, 1), "dq": np.einsum("bhij,bjhd->bihd", ds, kk),
            "dk": fold(np.einsum("bhij,bihd->bjhd", ds, q)), "dv": fold(np.einsum("bhij,bihd->bjhd", p, do))}


@pytest.fixture
def emulated(clean):
    import _cudnn_emulator as emulator
    attention._cudnn, attention._handle = emulator, emulator.create_handle()
    yield emulator


MODES = {  # name: (packed mask, PACKED settings)
    "plain": (None, {}),
    "ragged": ("ragged", {"max_seq": "row"}),
    "ragged-longest": ("ragged", {"max_seq": "longest"}),
    "ragged-groups": ("ragged", {"max_seq": "longest", "bounds": (2, 4)}),
    "ragged-options": ("ragged", {"max_seq": "longest", "deterministic": True, "implementation": "UNIFIED",
                                  "engine": {"fwd": "emulated_1", "bwd": "emulated_1"}}),
    "bias": ("bias", {}),
}


def bias_buffer(pos):
    from lorac.runtime.devices.cuda.documents import document_bias
    bias = document_bias(pos)
    buf = _Buffer(bias.shape, "bfloat16")
    buf.copyfrom(bf16(bias))
    return buf


@pytest.mark.parametrize("mode", list(MODES))
def test_plans_describe_each_document_to_cudnn(emulated, mode):
    """What lorac describes to cuDNN (dims, token-major strides, each tensor's ragged offsets,
    the stats layout, lengths; or the documents' bias), run by the emulator as cuDNN's
    documentation defines it: the packed plans compute the packed graph's attention
    (graphs/ops/attention.py's mask) and its gradients, write nothing past the tokens (the
    empty sequences start there), and the plain ones causal attention over whole rows. Ragged
    plans as long as the longest document (rounded up to 64 tokens: here the row) or split by
    length into groups of plans (documents of 1-2, 3-4 and 5 tokens) compute the same."""
    mask, settings = MODES[mode]
    attention.PACKED.update(settings)
    B, S, H, K, Dh, scale = 2, 80, 4, 2, 8, 0.3
    pos = rows((30, 1, 40, 9), (2, 2, 1, 2, 5, 40, 28)) if mask else rows((80,), (80,))
    attention.reserve_documents(8, 40)  # capacity 16 > 11 documents: empty sequences too
    fns = (attention.PACKED_FWD, attention.PACKED_BWD) if mask else (attention.FWD, attention.BWD)
    calls = [{"function": fn, "B": B, "S": S, "H": H, "K": K, "Dh": Dh, "scale": scale, **({"mask": mask} if mask else {})}
             for fn in fns]
    fwd, bwd = (attention.build_plan(c, _Buffer)[0] for c in calls)
    attention.size_workspace(_Buffer)
    for plan in fwd + bwd:
        attention.warm(plan, _Buffer)
    feed = attention.feeder(SimpleNamespace(unit_calls=calls))
    assert (feed is None) != (mask == "ragged")
    if mask == "ragged":
        docs = fwd[0].docs
        assert all(p.docs is docs for p in fwd + bwd) and len(fwd) == len(bwd) == len(docs.groups)
        groups = [(g.lo, g.hi, g.max_seq, g.capacity) for g in docs.groups]
        assert groups == ([(0, 2, 64, 16), (2, 4, 64, 16), (4, 40, 64, 16)] if settings.get("bounds") else
                          [(0, 80, 80, 16)] if settings.get("max_seq") == "row" else [(0, 40, 64, 16)])
        feed({"position_ids": pos})
    if settings.get("engine"):
        assert fwd[0].graph.selected == bwd[0].graph.selected == 1
    # bias plans: the causal band one key past the longest reserved document (40 of 80 tokens)
    assert [p.options.get("band") for p in fwd + bwd] == ([41, 41] if mask == "bias" else [None] * len(fwd + bwd))
    rng = np.random.default_rng(3)
    x = {n: bf16(rng.standard_normal((B, S, h, Dh))) for n, h in (("q", H), ("k", K), ("v", K), ("do", H))}
    pad = lambda h, dtype="bfloat16": _Buffer(((B + 1) * S * h * (Dh if dtype == "bfloat16" else 1),), dtype)  # noqa
    out = {"o": pad(H), "lse": pad(H, "float32"), "dq": pad(H), "dk": pad(K), "dv": pad(K)}
    ins = {n: _Buffer(a.shape, "bfloat16") for n, a in x.items()}
    for n, a in x.items():
        ins[n].copyfrom(a)
    ins["bias"] = bias_buffer(pos)
    buffers = {**ins, **out}
    attention._run(fwd, [buffers[n] for n in fwd[0].names])
    attention._run(bwd, [buffers[n] for n in bwd[0].names])
    want = reference(*(f64(x[n]) for n in ("q", "k", "v", "do")), graph_mask(pos), scale)
    T = B * S
    for n, h in (("o", H), ("dq", H), ("dk", K), ("dv", K)):
        got = f64(out[n].a[:T * h * Dh]).reshape(B, S, h, Dh)
        np.testing.assert_allclose(got, want[n], atol=2e-2 * np.abs(want[n]).max(), err_msg=n)
        assert (out[n].a[T * h * Dh:] == 0x7FC0).all(), f"{n}: written past the tokens"
    lse = out["lse"].a
    got = lse[:T * H].reshape(B, S, H) if mask == "ragged" else lse[:T * H].reshape(B, H, S).transpose(0, 2, 1)
    np.testing.assert_allclose(got, want["lse"], rtol=1e-5, atol=1e-5)
    assert (lse[T * H:] == -7).all()


def test_unknown_masks_and_engines_are_refused(emulated):
    call = {"function": attention.PACKED_FWD, "B": 1, "S": 4, "H": 2, "K": 1, "Dh": 8, "scale": 0.5}
    with pytest.raises(LoracError, match="masks documents by 'alibi'; this runtime knows ragged, bias"):
        attention.build_plan({**call, "mask": "alibi"}, _Buffer)
    attention.PACKED["engine"] = {"fwd": "eng99"}
    with pytest.raises(LoracError, match="no fused attention plan for B=1 S=4 heads=2/1 head_dim=8 packed in 4 "
                                         "sequences of at most 4 tokens: no cuDNN plan named 'eng99'"):
        attention.build_plan(call, _Buffer)


def test_groups_bound_capacity_and_length():
    """A row of S tokens holds at most S // (lo + 1) documents longer than lo: the groups' plans
    need no more sequences than that (and no more than the documents a row holds)."""
    from lorac.runtime.devices.cuda.documents import Group, groups_for
    assert groups_for(2, 1024, 40, 700, (128, 256)) == (
        Group(0, 128, 128, 80), Group(128, 256, 256, 14), Group(256, 700, 704, 6))
    assert groups_for(2, 1024, 40, 100, (128,)) == (Group(0, 100, 128, 80),)  # bounds past the longest go
    assert groups_for(2, 1000, None, None) == (Group(0, 1000, 1000, 2000),)  # nothing reserved: S, every token
    assert groups_for(8, 1024, 3, 1000, (64,)) == (Group(0, 64, 64, 24), Group(64, 1000, 1024, 24))


def test_documents_fill_each_group_and_refuse_what_the_plans_cannot_hold():
    from lorac.runtime.devices.cuda.documents import Documents, groups_for
    B, S = 4, 64
    pos = _random_rows(np.random.default_rng(1), B, S, 2, 12)
    lengths, starts = split_documents(pos, int((pos == 0).sum()))
    docs = Documents(B, S, groups_for(B, S, 12, int(lengths.max()), (4, 16)), _Buffer)
    assert [(g.lo, g.hi) for g in docs.groups] == [(0, 4), (4, 16), (16, int(lengths.max()))]
    docs.fill(pos)
    seen, found = np.zeros((B * S, B * S), bool), []
    for i, g in enumerate(docs.groups):
        lens, off = docs.lengths[i].a, docs.offsets_of(i, 3).a // 3
        n = int((lens > 0).sum())
        assert (lens[:n] > g.lo).all() and (lens[:n] <= g.hi).all() and not lens[n:].any()
        assert (off[n:] == B * S).all() and (np.diff(off[:n]) > 0).all()  # token order, empty ones at the end
        found += list(zip(off[:n].tolist(), lens[:n].tolist()))
        for a, m in zip(off[:n].tolist(), lens[:n].tolist()):
            seen[a:a + m, a:a + m] = np.tril(np.ones((m, m), bool))
    assert sorted(found) == sorted(zip(starts[:-1].tolist(), lengths.tolist()))
    blocks = seen.reshape(B, S, B, S)[np.arange(B), :, np.arange(B), :]
    np.testing.assert_array_equal(blocks, graph_mask(pos))
    short = Documents(B, S, groups_for(B, S, 12, 8), _Buffer)
    with pytest.raises(LoracError, match="holds a document of [0-9]+ tokens; the packed attention was prepared for "
                                         "documents of at most 8"):
        short.fill(pos)
    few = Documents(1, S, groups_for(1, S, 12, S, (4,)), _Buffer)  # 12 sequences a group
    thirteen = np.concatenate([np.zeros(13, np.int64), np.arange(S - 13)])[None]  # 13 one-token documents, then one
    with pytest.raises(LoracError, match=r"batch of 1 rows holds 13 documents of 1..4 tokens; .* at most 12"):
        few.fill(thirteen)


def test_document_bias_is_the_graph_mask():
    from lorac.runtime.devices.cuda.documents import MASKED, document_bias
    from lorac.graphs.ops.attention import MASKED as GRAPH_MASKED
    assert MASKED == GRAPH_MASKED
    pos = rows((3, 1, 5, 3), (12,), (1,) * 12)
    bias = document_bias(pos)
    assert bias.shape == (3, 1, 12, 12) and bias.dtype == np.float32
    causal = np.tril(np.ones((12, 12), bool))
    np.testing.assert_array_equal((bias[:, 0] == 0) & causal, graph_mask(pos))
    assert set(np.unique(bias).tolist()) <= {0.0, np.float32(MASKED)}


def test_bias_plans_band_reaches_the_reserved_documents(emulated):
    """The band of bias plans is what keeps them exact: built for documents of at most 20
    tokens, a row holding a 40-token one comes out wrong (so the band is applied); reserving
    40 builds them again (the same key), and then they equal the packed graph's attention. A
    reservation of shorter documents keeps the wider plans; no reservation, or documents as
    long as the row, or PACKED["band"] off, build them without a band."""
    B, S, H, K, Dh, scale = 2, 64, 2, 1, 8, 0.4
    pos = rows((40, 24), (3, 5, 56))
    call = {"function": attention.PACKED_FWD, "B": B, "S": S, "H": H, "K": K, "Dh": Dh, "scale": scale, "mask": "bias"}
    rng = np.random.default_rng(9)
    x = {n: bf16(rng.standard_normal((B, S, h, Dh))) for n, h in (("q", H), ("k", K), ("v", K), ("do", H))}
    want = reference(*(f64(x[n]) for n in ("q", "k", "v", "do")), graph_mask(pos), scale)["o"]

    def attend(longest):
        attention.reserve_documents(8, longest)
        plans, built = attention.build_plan(call, _Buffer)
        attention.size_workspace(_Buffer)
        ins = {n: _Buffer(a.shape, "bfloat16") for n, a in x.items()}
        for n, a in x.items():
            ins[n].copyfrom(a)
        o, lse = _Buffer((B * S * H * Dh,), "bfloat16"), _Buffer((B * S * H,), "float32")
        attention._run(plans, [ins["q"], ins["k"], ins["v"], bias_buffer(pos), o, lse])
        return plans[0].options.get("band"), built, f64(o.a).reshape(B, S, H, Dh)

    band, built, o = attend(20)
    assert (band, built) == (21, True)
    assert not np.allclose(o, want, atol=2e-2 * np.abs(want).max())  # keys 21+ back are cut
    band, built, o = attend(56)
    assert (band, built) == (57, True)
    np.testing.assert_allclose(o, want, atol=2e-2 * np.abs(want).max())
    assert attend(30)[:2] == (57, False)  # shorter documents: the wider plans serve
    assert attend(None)[:2] == (None, True)  # nothing reserved: the whole causal triangle
    attention._plans.clear()
    attention.PACKED["band"] = False  # off: the whole triangle, whatever was reserved
    band, built, o = attend(20)
    assert (band, built) == (None, True)
    np.testing.assert_allclose(o, want, atol=2e-2 * np.abs(want).max())
    attention.reserve_documents(8, None)
    assert attention.band(64) is None and attention.band(65) is None
    attention.reserve_documents(8, 63)
    assert attention.band(64) is None and attention.band(65) == 64


@pytest.mark.parametrize("mask", ["ragged", "bias"])
def test_registered_functions_read_the_fed_documents(emulated, mask):
    """The path a compiled step takes, with TVM's runtime on the CPU and the emulator for cuDNN:
    prepare() builds, warms and registers the packed functions, the feeder fills the documents
    of each call's position_ids (ragged; a bias build feeds nothing: the step computes the bias),
    and the registered functions (called as the VM calls them) compute each batch's documents,
    the second batch's too (what a replayed capture reads)."""
    tvm = pytest.importorskip("tvm")
    import tvm_ffi
    from lorac.runtime.devices.cuda.documents import document_bias
    B, S, H, K, Dh, scale = 2, 10, 2, 1, 8, 0.5
    calls = [{"function": fn, "B": B, "S": S, "H": H, "K": K, "Dh": Dh, "scale": scale, "mask": mask}
             for fn in (attention.PACKED_FWD, attention.PACKED_BWD)]
    manifest = SimpleNamespace(unit_calls=calls)
    attention.reserve_documents(4, 10)
    dev = tvm.cpu()
    attention.prepare(manifest, dev)
    feed = attention.feeder(manifest)
    assert (feed is None) == (mask == "bias")
    rng = np.random.default_rng(5)
    t = lambda a: tvm.runtime.tensor(a, dev)  # noqa: E731
    for docs in [((3, 7), (1, 1, 4, 4)), ((10,), (2, 8))]:
        pos = rows(*docs)
        x = {n: bf16(rng.standard_normal((B, S, h, Dh))) for n, h in (("q", H), ("k", K), ("v", K), ("do", H))}
        dv = {n: t(a.view(np.uint16)) for n, a in x.items()}  # bf16 bits; the functions read addresses only
        o, dq = t(np.zeros((B, S, H, Dh), np.uint16)), t(np.zeros((B, S, H, Dh), np.uint16))
        dk, dvv = t(np.zeros((B, S, K, Dh), np.uint16)), t(np.zeros((B, S, K, Dh), np.uint16))
        lse = t(np.zeros((B, S, H, 1) if mask == "ragged" else (B, H, S, 1), np.float32))
        if feed:
            feed({"position_ids": pos})
        arg = t(pos) if mask == "ragged" else t(bf16(document_bias(pos)))
        tvm_ffi.get_global_func(attention.PACKED_FWD)(dv["q"], dv["k"], dv["v"], arg, o, lse)
        tvm_ffi.get_global_func(attention.PACKED_BWD)(dv["q"], dv["k"], dv["v"], o, dv["do"], lse, arg, dq, dk, dvv)
        want = reference(*(f64(x[n]) for n in ("q", "k", "v", "do")), graph_mask(pos), scale)
        for name, got in (("o", o), ("dq", dq), ("dk", dk), ("dv", dvv)):
            np.testing.assert_allclose(f64(got.numpy()), want[name], atol=2e-2 * np.abs(want[name]).max(), err_msg=name)
        got = lse.numpy()[..., 0]
        np.testing.assert_allclose(got if mask == "ragged" else got.transpose(0, 2, 1), want["lse"], rtol=1e-5, atol=1e-5)
