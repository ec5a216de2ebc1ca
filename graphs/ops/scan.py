"""Mamba-1 selective scan in plain ONNX ops, chunked, forward and backward.

Shape legend: B batch, S seq, I channels (intermediate), M state size, L chunk length,
C = ceil(S / L) chunks, P = C*L the padded length. u, dt, y [B, S, I]; A [I, M] (< 0);
Bm, Cm [B, S, M]; D [I].

    h_t = exp(dt_t A) * h_{t-1} + dt_t u_t Bm_t        (h [I, M] per batch row, h_{-1} = 0)
    y_t = h_t Cm_t + D u_t                              (sum over M)

ONNX has Loop/Scan but TVM's frontend reads neither, and an unrolled recurrence is O(S)
nodes. Here time is cut into C chunks of L steps; inside a chunk, with
lam_t = sum_{r<=t} dt_r A (a prefix sum inside each chunk) and w_s = dt_s u_s Bm_s:

    h_t = sum_{s<=t} exp(lam_t - lam_s) w_s  +  exp(lam_t) h0      (h0: state entering the chunk)

The first term is computed for all chunks at once as a masked [L, L] contraction; every
exponent lam_t - lam_s (s <= t) and lam_t is <= 0, and masked entries are -inf before the
Exp, so nothing can overflow. Only h0 couples chunks: h0_{c+1} = exp(lam_{c,L-1}) h0_c +
hin_{c,L-1}, a first-order linear recurrence over C chunks, evaluated for all chunks at once
in ceil(log2 C) doubling steps (no per-chunk nodes: an unrolled chain of C steps made TVM's
CPU build time grow ~quadratically with C, 253 s for one layer at C = 128).
The sequence is zero-padded at the end to P (dt = 0 there: decay 1, no input); the scan is
causal, so padding after the last step changes nothing before it.
The forward keeps only h0 [B, C, I, M]; the backward recomputes lam, w and the decays.
docs/MAMBA.md has the derivation of the backward and the cost per chunk length.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ScanDims:
    batch: int
    seq: int
    channels: int  # I
    state: int  # M
    chunk: int  # L

    @property
    def n_chunks(self) -> int:
        return -(-self.seq // self.chunk)

    @property
    def pad(self) -> int:
        return self.n_chunks * self.chunk - self.seq


def _chunk(g, x, width: int, d: ScanDims):
    """[B, S, W] -> [B, C, L, W], zero-padded at the end of time."""
    if d.pad:
        x = g.op("Pad", x, g.ints(0, 0, 0, 0, d.pad, 0))
    return g.reshape(x, d.batch, d.n_chunks, d.chunk, width)


def _unchunk(g, x, width: int, d: ScanDims):
    """[B, C, L, W] -> [B, S, W], padding dropped."""
    x = g.reshape(x, d.batch, d.n_chunks * d.chunk, width)
    return g.slice(x, 0, d.seq, 1) if d.pad else x


def _unsq(g, x, axis: int):
    return g.op("Unsqueeze", x, g.ints(axis))


def _sum(g, x, axis: int):
    return g.op("ReduceSum", x, g.ints(axis), keepdims=0)


def _decay(g, lam, d: ScanDims):
    """[B, C, L, I, M] -> exp(lam_t - lam_s) for s <= t, 0 above the diagonal: [B, C, L(t), L(s), I, M]."""
    causal = np.tril(np.ones((d.chunk, d.chunk), dtype=bool))[:, :, None, None]
    seg = g.op("Sub", _unsq(g, lam, 3), _unsq(g, lam, 2))
    return g.op("Exp", g.op("Where", g.const(causal), seg, g.f(-np.inf)))


def _intra(g, uc, dtc, A, Bc, d: ScanDims):
    """Per-chunk quantities -> (lam, xb = dt u, w = xb Bm, decay, hin = zero-start states)."""
    lam = _chunk_cumsum(g, g.op("Mul", _unsq(g, dtc, -1), A), d)  # [B, C, L, I, M], <= 0
    xb = g.op("Mul", dtc, uc)  # [B, C, L, I]
    w = g.op("Mul", _unsq(g, xb, -1), _unsq(g, Bc, 3))  # [B, C, L, I, M]
    dec = _decay(g, lam, d)
    hin = _sum(g, g.op("Mul", dec, _unsq(g, w, 2)), 3)  # sum over s
    return lam, xb, w, dec, hin


def _last(g, x, d: ScanDims):
    """[B, C, L, I, M] -> the chunk's last step [B, C, I, M]."""
    return g.reshape(g.slice(x, d.chunk - 1, d.chunk, 2), d.batch, d.n_chunks, d.channels, d.state)


def _shift(g, x, k: int, d: ScanDims, fill: float, reverse: bool, axis: int = 1, ndim: int = 4):
    """x moved k steps later (reverse: earlier) along `axis`, `fill` shifted in. Default: chunks
    of [B, C, I, M]; axis 2 of ndim 5 is time inside a chunk of [B, C, L, I, M]."""
    n = d.n_chunks if axis == 1 else d.chunk
    pads = [0] * (2 * ndim)
    pads[axis + (ndim if reverse else 0)] = k
    x = g.op("Pad", x, g.ints(*pads), g.f(fill))
    return g.slice(x, k, k + n, axis) if reverse else g.slice(x, 0, n, axis)


def _chunk_cumsum(g, x, d: ScanDims, reverse: bool = False):
    # inclusive prefix sum over time inside each chunk (axis 2 of [B, C, L, I, M]) in
    # ceil(log2 L) shifted adds: ONNX CumSum lowers to a TVM scan kernel that took 95 % of a
    # Mamba step on the H200
    k = 1
    while k < d.chunk:
        x = g.op("Add", x, _shift(g, x, k, d, 0.0, reverse, axis=2, ndim=5))
        k *= 2
    return x


def _linear_scan(g, coef, x, d: ScanDims, reverse: bool = False):
    # y_c = x_c + coef_c y_{c-1} (reverse: y_{c+1}) for all c, in ceil(log2 C) doubling steps
    # (Hillis-Steele): after the step of span k, (coef_c, y_c) compose the 2k chunks ending at
    # c: y_c += coef_c y_{c-k}, coef_c *= coef_{c-k}. coef <= 1 here: products only shrink.
    # Each step's results pass through g.kept: a compiler that fuses the whole chain into one
    # kernel recomputes every level twice per level above it (2^levels = C reads per output;
    # TVM did: 11 s of a 31 s one-layer CPU step at 8x1024).
    k = 1
    while k < d.n_chunks:
        y_prev = _shift(g, x, k, d, 0.0, reverse)
        x = g.kept(g.op("Add", x, g.op("Mul", coef, y_prev)))
        if 2 * k < d.n_chunks:
            coef = g.kept(g.op("Mul", coef, _shift(g, coef, k, d, 1.0, reverse)))
        k *= 2
    return x


def _carry_forward(g, e_last, h_last, d: ScanDims):
    # h0_0 = 0; h0_{c+1} = E_c h0_c + hin_{c,L-1} with E_c = exp(lam_{c,L-1}) -> [B, C, I, M]:
    # the inclusive scan s_c = hin_{c,L-1} + E_c s_{c-1} shifted by one chunk
    return _shift(g, _linear_scan(g, e_last, h_last, d), 1, d, 0.0, False)


def _carry_backward(g, dh0, e_last, d: ScanDims):
    # G_c = dL/dh0_c in total: G_{C-1} = dh0_{C-1}, G_c = dh0_c + E_c G_{c+1} (a reverse scan).
    # Returns gnext [B, C, I, M] with chunk c holding G_{c+1} (0 for the last chunk): the
    # gradient reaching hin_{c,L-1} and, times E_c h0_c, lam_{c,L-1}.
    return _shift(g, _linear_scan(g, e_last, dh0, d, reverse=True), 1, d, 0.0, True)


def _variant(d: ScanDims, np_float) -> str:
    return f"B={d.batch} S={d.seq} I={d.channels} M={d.state} L={d.chunk} {np.dtype(np_float).name}"


def scan_forward(g, u, dt, A, Bm, Cm, D, d: ScanDims):
    """-> (y [B, S, I], saved h0 [B, C, I, M]: the state entering each chunk). The unit
    lorac.SelectiveScan; its `chunk` attribute is L, for a compiler that maps it whole."""
    return g.call("SelectiveScan", _variant(d, g.np_float), [u, dt, A, Bm, Cm, D], 2,
                  lambda fb, *x: _forward_body(fb, *x, d), chunk=d.chunk)


def scan_backward(g, dy, u, dt, A, Bm, Cm, D, h0, d: ScanDims):
    """dy [B, S, I] -> (du, ddt [B, S, I], dBm, dCm [B, S, M]); A and D are frozen. The unit
    lorac.SelectiveScanGrad."""
    return g.call("SelectiveScanGrad", _variant(d, g.np_float), [dy, u, dt, A, Bm, Cm, D, h0], 4,
                  lambda fb, *x: _backward_body(fb, *x, d), chunk=d.chunk)


# -- the unit bodies (default-domain ONNX) ------------------------------------------------
def _forward_body(g, u, dt, A, Bm, Cm, D, d: ScanDims):
    I, M = d.channels, d.state
    uc, dtc, Bc, Cc = _chunk(g, u, I, d), _chunk(g, dt, I, d), _chunk(g, Bm, M, d), _chunk(g, Cm, M, d)
    lam, _, _, _, hin = _intra(g, uc, dtc, A, Bc, d)
    elam = g.op("Exp", lam)
    h0 = _carry_forward(g, _last(g, elam, d), _last(g, hin, d), d)
    h = g.op("Add", hin, g.op("Mul", elam, _unsq(g, h0, 2)))
    y = _unchunk(g, _sum(g, g.op("Mul", h, _unsq(g, Cc, 3)), -1), I, d)
    return g.op("Add", y, g.op("Mul", u, D)), h0


def _backward_body(g, dy, u, dt, A, Bm, Cm, D, h0, d: ScanDims):
    """With h = hin + hc, hc = exp(lam) h0:   dCm = sum_I dy h,  dh = dy Cm,
      dh0 (local) = sum_t dh exp(lam_t),   dlam += dh hc,
      chain: dhin_{L-1} += G_{c+1},        dlam_{L-1} += G_{c+1} E_c h0_c,
      hin_t = sum_s P_ts w_s, P_ts = exp(lam_t - lam_s):
        dw_s = sum_t P_ts dhin_t,  dlam_t += dhin_t hin_t,  dlam_s -= w_s dw_s
      (sum_s dP_ts P_ts w_s = dhin_t hin_t, so the [L, L] block is contracted only once),
      lam = cumsum(dt A): d(dt A) = reverse cumsum of dlam; w = dt u Bm.
    """
    I, M = d.channels, d.state
    uc, dtc, Bc, Cc = _chunk(g, u, I, d), _chunk(g, dt, I, d), _chunk(g, Bm, M, d), _chunk(g, Cm, M, d)
    lam, xb, w, dec, hin = _intra(g, uc, dtc, A, Bc, d)
    elam = g.op("Exp", lam)
    hc = g.op("Mul", elam, _unsq(g, h0, 2))
    h = g.op("Add", hin, hc)
    dyc = _unsq(g, _chunk(g, dy, I, d), -1)  # [B, C, L, I, 1]
    dC = _sum(g, g.op("Mul", dyc, h), 3)  # [B, C, L, M]
    dh = g.op("Mul", dyc, _unsq(g, Cc, 3))  # [B, C, L, I, M]
    dlam = g.op("Mul", dh, hc)
    dhin = dh
    if d.n_chunks > 1:
        e_last = _last(g, elam, d)
        dh0 = _sum(g, g.op("Mul", dh, elam), 2)
        gnext = _unsq(g, _carry_backward(g, dh0, e_last, d), 2)  # [B, C, 1, I, M]
        at_last = g.fconst(np.eye(d.chunk)[-1][:, None, None])  # [L, 1, 1]: 1 at the chunk's last step
        dhin = g.op("Add", dhin, g.op("Mul", gnext, at_last))
        carry = _unsq(g, g.op("Mul", e_last, h0), 2)
        dlam = g.op("Add", dlam, g.op("Mul", g.op("Mul", gnext, carry), at_last))
    dw = _sum(g, g.op("Mul", dec, _unsq(g, dhin, 3)), 2)  # sum over t -> [B, C, L(s), I, M]
    dlam = g.op("Add", dlam, g.op("Sub", g.op("Mul", dhin, hin), g.op("Mul", w, dw)))
    da = _chunk_cumsum(g, dlam, d, reverse=True)
    dxb = _sum(g, g.op("Mul", dw, _unsq(g, Bc, 3)), -1)  # [B, C, L, I]
    dB = _sum(g, g.op("Mul", dw, _unsq(g, xb, -1)), 3)  # [B, C, L, M]
    ddt = g.op("Add", _sum(g, g.op("Mul", da, A), -1), g.op("Mul", dxb, uc))
    du = _unchunk(g, g.op("Mul", dxb, dtc), I, d)
    du = g.op("Add", du, g.op("Mul", dy, D))
    return du, _unchunk(g, ddt, I, d), _unchunk(g, dB, M, d), _unchunk(g, dC, M, d)
