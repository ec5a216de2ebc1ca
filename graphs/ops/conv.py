"""Causal depthwise conv1d over time (Mamba's short convolution), forward and backward.

Shapes: B batch, S seq, I channels, K kernel; x, y [B, S, I]; w [I, 1, K] (HF/PyTorch
Conv1d layout with groups=I), bias [I]. The weight and bias are frozen: only dx is needed.

    y[t, i] = bias[i] + sum_k w[i, k] x[t + k - (K-1), i]      (x[<0] = 0: causal padding)

Written as K shifted slices of a front-padded x times a per-channel weight row, not as an
ONNX Conv: K is tiny (4), the K Mul/Add nodes fuse into one elementwise loop in TVM and
ORT, the backward is the same construction with the padding at the back (a correlation
with the taps reversed) instead of a ConvTranspose, and no depthwise-conv schedule is
needed on targets where TVM has only generic ones. Chained Adds rather than one variadic Sum:
onnxruntime-training (oracle 3) has no gradient for Sum.
"""
from __future__ import annotations


def _taps(g, w, channels: int, kernel: int):
    """w [I, 1, K] -> K rows [1, I], row k = w[:, 0, k], broadcasting over [B, S, I]."""
    wt = g.transpose(g.reshape(w, channels, kernel), 1, 0)
    return [g.slice(wt, k, k + 1, 0) for k in range(kernel)]


def _pad_time(g, x, front: int, back: int):
    """Zero-pad axis 1 of a [B, S, I] value."""
    return g.op("Pad", x, g.ints(0, front, 0, 0, back, 0))


def conv_forward(g, x, w, bias, seq: int, channels: int, kernel: int):
    # y[t] = sum_k w[k] xp[t + k], xp = x with K-1 zeros in front
    taps = _taps(g, w, channels, kernel)
    xp = _pad_time(g, x, kernel - 1, 0) if kernel > 1 else x
    y = bias
    for k in range(kernel):
        term = g.op("Mul", g.slice(xp, k, k + seq, 1), taps[k])
        y = term if y is None else g.op("Add", y, term)
    return y


def conv_backward(g, dy, w, seq: int, channels: int, kernel: int):
    # x[j] feeds y[j - k + K-1] through tap k, so dx[j] = sum_k w[k] dyp[j + K-1-k],
    # dyp = dy with K-1 zeros at the back (outputs past the end do not exist)
    taps = _taps(g, w, channels, kernel)
    dyp = _pad_time(g, dy, 0, kernel - 1) if kernel > 1 else dy
    s = kernel - 1
    dx = None
    for k in range(kernel):
        term = g.op("Mul", g.slice(dyp, s - k, s - k + seq, 1), taps[k])
        dx = term if dx is None else g.op("Add", dx, term)
    return dx
