"""Causal attention over packed documents as Triton kernels that skip whole tiles outside each
query's document (--packing isolated on CUDA, the mask "kernel" of
compiler/targets/cuda/attention.py).

cuDNN masks packed documents either by an additive bias, which still computes every causal
tile, or as ragged sequences, whose kernels launch a grid as long as the longest document for
every sequence; at rows of up to 1024 tokens both cost 1.3-1.8x the plain causal call
(docs/BENCHMARKS.md). Here a tile of queries reads keys only from its first query's document
start on, and a tile of keys only meets queries up to the end of its last key's document, so
the work follows the documents' own triangles.

Layout (the graph's, token-major): q, o, do, dq [B, S, H, D] and k, v, dk, dv [B, S, KH, D]
bf16, KH dividing H (grouped-query attention: query head h reads key head h // (H // KH));
pos [B, S] the position ids (integers; each document numbered 0, 1, 2, ... from its first
token, so query i's document starts at key i - pos[i]); lse [B, S, H] fp32, the natural
log-sum-exp of each softmax row; delta [B, S, H] fp32, rowsum(o * do), the backward's first
kernel. The softmax scale comes as `scale`; exp2 with scale * log2(e) inside.

Kernels (grids: tiles of the sequence x batch*heads):
    fwd       (cdiv(S, BM), B*H)    o, lse
    delta     (cdiv(S, BM), B*H)    delta
    bwd_kv    (cdiv(S, BN), B*KH)   dk, dv (each key head's query heads summed in the program)
    bwd_q     (cdiv(S, BM), B*H)    dq
"""
from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def _doc_lo(POS, b, S, m0, BN: tl.constexpr):
    """The first key tile a query tile starting at m0 reads: its first query's document start,
    rounded down to BN (documents start no later for later queries); never before the row."""
    first = m0 - tl.load(POS + b * S + m0).to(tl.int32)
    return tl.maximum(first, 0) // BN * BN


@triton.jit
def _rows(S, H: tl.constexpr, BM: tl.constexpr):
    """This program's tile of queries: (its first query m0, the batch row b, the query head h,
    the tile's rows, which of them lie inside the row)."""
    m0 = tl.program_id(0) * BM
    bh = tl.program_id(1)
    rows = m0 + tl.arange(0, BM)
    return m0, bh // H, bh % H, rows, rows < S


@triton.jit
def _query_tile(POS, S, H: tl.constexpr, KH: tl.constexpr, D: tl.constexpr, BM: tl.constexpr):
    """_rows, and the key head, the head's columns and each row's document start."""
    m0, b, h, rows, inside = _rows(S, H, BM)
    first = rows - tl.load(POS + b * S + rows, mask=inside, other=0).to(tl.int32)
    return m0, b, h, h // (H // KH), rows, inside, tl.arange(0, D), first


@triton.jit
def fwd(Q, K, V, POS, O, LSE, scale, S,
        H: tl.constexpr, KH: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    m0, b, h, kh, rows, inside, d, first = _query_tile(POS, S, H, KH, D, BM)
    q = tl.load(Q + ((b * S + rows) * H + h)[:, None] * D + d[None, :], mask=inside[:, None], other=0.0)
    scale2 = scale * 1.4426950408889634
    m_i = tl.full([BM], -1.0e30, tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    hi = tl.minimum(m0 + BM, S)
    for n0 in range(_doc_lo(POS, b, S, m0, BN), hi, BN):
        cols = n0 + tl.arange(0, BN)
        kv = ((b * S + cols) * KH + kh) * D
        k = tl.load(K + kv[None, :] + d[:, None], mask=(cols < S)[None, :], other=0.0)
        s = tl.dot(q, k) * scale2
        keep = (cols[None, :] <= rows[:, None]) & (cols[None, :] >= first[:, None])
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + kv[:, None] + d[None, :], mask=(cols < S)[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    l_i = tl.where(inside, l_i, 1.0)
    out = acc / l_i[:, None]
    tl.store(O + ((b * S + rows) * H + h)[:, None] * D + d[None, :], out.to(O.dtype.element_ty),
             mask=inside[:, None])
    tl.store(LSE + (b * S + rows) * H + h, (m_i + tl.math.log2(l_i)) * 0.6931471805599453, mask=inside)


@triton.jit
def delta(O, DO, DELTA, S, H: tl.constexpr, D: tl.constexpr, BM: tl.constexpr):
    _, b, h, rows, inside = _rows(S, H, BM)
    at = ((b * S + rows) * H + h)[:, None] * D + tl.arange(0, D)[None, :]
    o = tl.load(O + at, mask=inside[:, None], other=0.0).to(tl.float32)
    do = tl.load(DO + at, mask=inside[:, None], other=0.0).to(tl.float32)
    tl.store(DELTA + (b * S + rows) * H + h, tl.sum(o * do, 1), mask=inside)


@triton.jit
def bwd_kv(Q, K, V, DO, LSE, DELTA, POS, DK, DV, scale, S,
           H: tl.constexpr, KH: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    n0 = tl.program_id(0) * BN
    bk = tl.program_id(1)
    b = bk // KH
    kh = bk % KH
    G: tl.constexpr = H // KH
    cols = n0 + tl.arange(0, BN)
    keys = cols < S
    d = tl.arange(0, D)
    kv = ((b * S + cols) * KH + kh)[:, None] * D + d[None, :]
    k = tl.load(K + kv, mask=keys[:, None], other=0.0)
    v = tl.load(V + kv, mask=keys[:, None], other=0.0)
    scale2 = scale * 1.4426950408889634
    dk = tl.zeros([BN, D], tl.float32)
    dv = tl.zeros([BN, D], tl.float32)
    last = tl.minimum(n0 + BN, S) - 1  # queries past the end of this key's document see none of the tile
    start = n0 // BM * BM
    for g in range(G):
        h = kh * G + g
        m0 = start
        more = m0 < S
        while more:
            rows = m0 + tl.arange(0, BM)
            inside = rows < S
            qa = ((b * S + rows) * H + h)[:, None] * D + d[None, :]
            q = tl.load(Q + qa, mask=inside[:, None], other=0.0)
            do = tl.load(DO + qa, mask=inside[:, None], other=0.0)
            first = rows - tl.load(POS + b * S + rows, mask=inside, other=0).to(tl.int32)
            lse2 = tl.load(LSE + (b * S + rows) * H + h, mask=inside, other=0.0) * 1.4426950408889634
            dl = tl.load(DELTA + (b * S + rows) * H + h, mask=inside, other=0.0)
            st = tl.dot(k, tl.trans(q)) * scale2
            keep = (cols[:, None] <= rows[None, :]) & (cols[:, None] >= first[None, :]) & inside[None, :]
            pt = tl.where(keep, tl.math.exp2(st - lse2[None, :]), 0.0)
            dv += tl.dot(pt.to(do.dtype), do)
            dpt = tl.dot(v, tl.trans(do))
            dst = pt * (dpt - dl[None, :])
            dk += tl.dot(dst.to(q.dtype), q)
            m0 += BM
            nxt = tl.load(POS + b * S + m0, mask=m0 < S, other=0).to(tl.int32)
            more = (m0 < S) & (m0 - nxt <= last)
    tl.store(DK + kv, (dk * scale).to(DK.dtype.element_ty), mask=keys[:, None])
    tl.store(DV + kv, dv.to(DV.dtype.element_ty), mask=keys[:, None])


@triton.jit
def bwd_q(Q, K, V, DO, LSE, DELTA, POS, DQ, scale, S,
          H: tl.constexpr, KH: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    m0, b, h, kh, rows, inside, d, first = _query_tile(POS, S, H, KH, D, BM)
    qa = ((b * S + rows) * H + h)[:, None] * D + d[None, :]
    q = tl.load(Q + qa, mask=inside[:, None], other=0.0)
    do = tl.load(DO + qa, mask=inside[:, None], other=0.0)
    lse2 = tl.load(LSE + (b * S + rows) * H + h, mask=inside, other=0.0) * 1.4426950408889634
    dl = tl.load(DELTA + (b * S + rows) * H + h, mask=inside, other=0.0)
    scale2 = scale * 1.4426950408889634
    dq = tl.zeros([BM, D], tl.float32)
    hi = tl.minimum(m0 + BM, S)
    for n0 in range(_doc_lo(POS, b, S, m0, BN), hi, BN):
        cols = n0 + tl.arange(0, BN)
        kv = ((b * S + cols) * KH + kh) * D
        k = tl.load(K + kv[:, None] + d[None, :], mask=(cols < S)[:, None], other=0.0)
        v = tl.load(V + kv[:, None] + d[None, :], mask=(cols < S)[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)) * scale2
        keep = (cols[None, :] <= rows[:, None]) & (cols[None, :] >= first[:, None])
        p = tl.where(keep, tl.math.exp2(s - lse2[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - dl[:, None])
        dq += tl.dot(ds.to(k.dtype), k)
    tl.store(DQ + qa, (dq * scale).to(DQ.dtype.element_ty), mask=inside[:, None])
