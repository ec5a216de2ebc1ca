"""llama.cpp's reference quantizers for the K-quants Q4_K, Q5_K and Q6_K, in numpy (the `gguf`
package dequantizes these types but has no quantizer for them).

A transcription of ggml-quants.c (`quantize_row_q4_K_ref`, `quantize_row_q5_K_ref`,
`quantize_row_q6_K_ref` and their helpers `make_qkx2_quants`, `make_qx_quants`, `nearest_int`)
that keeps the C code's float32 arithmetic operation for operation: every block is quantized
at once (numpy over blocks), while each sum runs over a block's elements in the C loop's
order, so the rounding is the same. Checked byte for byte against ggml-quants.c compiled with
`-ffp-contract=off` (tests/test_kquants.py has the digests; docs/WEIGHTS.md says how): a
llama.cpp build that contracts `a*b + c` into FMAs may round a near tie the other way, as two
llama.cpp builds may differ from each other.

    quantize(w, "Q4_K") -> uint8 [rows, cols/256 * 144]   (w float32 [rows, cols], cols % 256 == 0)
"""
from __future__ import annotations

import numpy as np

QK_K = 256
F32 = np.float32
BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
GROUP_MAX_EPS = F32(1e-15)


def nearest_int(v: np.ndarray) -> np.ndarray:
    """ggml's nearest_int (float + 1.5 * 2^23, read back as an integer): round half to even."""
    return np.rint(v).astype(np.int32)


def _f16(v) -> np.ndarray:
    """GGML_FP32_TO_FP16 then back: the fp16 a block stores, as float32."""
    return np.asarray(v, F32).astype(np.float16).astype(F32)


def _make_qkx2(x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int):
    """make_qkx2_quants over sub-blocks x [n, 32] with weights w -> (scale [n], the_min [n], L [n, 32])."""
    n = x.shape[1]
    mn, mx = x[:, 0].copy(), x[:, 0].copy()
    sum_w = w[:, 0].copy()
    sum_x = sum_w * x[:, 0]
    for i in range(1, n):
        mn = np.minimum(mn, x[:, i])
        mx = np.maximum(mx, x[:, i])
        sum_w = sum_w + w[:, i]
        sum_x = sum_x + w[:, i] * x[:, i]
    mn = np.where(mn > 0, F32(0), mn)
    flat = mx == mn  # L 0, scale 0, the min as it is (set at the end)
    iscale = F32(nmax) / np.where(flat, F32(1), mx - mn)
    scale = F32(1) / iscale
    L = np.clip(nearest_int(iscale[:, None] * (x - mn[:, None])), 0, nmax)
    Lf = L.astype(F32)
    best = np.zeros_like(mn)
    for i in range(n):
        diff = scale * Lf[:, i] + mn - x[:, i]
        best = best + w[:, i] * (diff * diff)
    for step in range(nstep + 1):  # the C loop's min moves with its best fit, so max - min does too
        span = np.where(flat, F32(1), mx - mn)
        iscale = (F32(rmin) + F32(rdelta) * F32(step) + F32(nmax)) / span
        aux = np.clip(nearest_int(iscale[:, None] * (x - mn[:, None])), 0, nmax)
        af = aux.astype(F32)
        sum_l = np.zeros_like(mn)
        sum_l2 = np.zeros_like(mn)
        sum_xl = np.zeros_like(mn)
        for i in range(n):
            wl = w[:, i] * af[:, i]
            sum_l = sum_l + wl
            sum_l2 = sum_l2 + wl * af[:, i]
            sum_xl = sum_xl + wl * x[:, i]
        D = sum_w * sum_l2 - sum_l * sum_l
        ok = D > 0
        Ds = np.where(ok, D, F32(1))
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / Ds
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / Ds
        pos = this_min > 0
        with np.errstate(divide="ignore", invalid="ignore"):
            this_scale = np.where(pos, sum_xl / sum_l2, this_scale)
        this_min = np.where(pos, F32(0), this_min)
        cur = np.zeros_like(mn)
        for i in range(n):
            diff = this_scale * af[:, i] + this_min - x[:, i]
            cur = cur + w[:, i] * (diff * diff)
        better = ok & (cur < best) & ~flat
        L = np.where(better[:, None], aux, L)
        best = np.where(better, cur, best)
        scale = np.where(better, this_scale, scale)
        mn = np.where(better, this_min, mn)
    scale = np.where(flat, F32(0), scale)
    L = np.where(flat[:, None], 0, L)
    return scale, -mn, L


def _scales_mins_k4(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins [n, 8] -> the 12 packed bytes of Q4_K/Q5_K [n, 12]."""
    out = np.zeros((ls.shape[0], 12), np.uint8)
    out[:, 0:4] = ls[:, :4]
    out[:, 4:8] = lm[:, :4]
    out[:, 8:12] = (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4)
    out[:, 0:4] |= (ls[:, 4:] >> 4) << 6
    out[:, 4:8] |= (lm[:, 4:] >> 4) << 6
    return out


def _kx(x: np.ndarray, nmax: int, rmin: float, nstep: int):
    """Q4_K/Q5_K's shared part over super-blocks x [nb, 256] -> (d, dmin, packed scales, L [nb, 256])."""
    nb = x.shape[0]
    sub = x.reshape(nb * 8, 32)
    sum_x2 = np.zeros(nb * 8, F32)
    for i in range(32):
        sum_x2 = sum_x2 + sub[:, i] * sub[:, i]
    av_x = np.sqrt(sum_x2 / F32(32))
    w = av_x[:, None] + np.abs(sub)
    scales, mins, L = _make_qkx2(sub, w, nmax, rmin, 0.1, nstep)
    scales, mins, L = scales.reshape(nb, 8), mins.reshape(nb, 8), L.reshape(nb, 256)
    max_scale = np.maximum(scales.max(axis=1), F32(0))  # the C loop's running max from 0
    max_min = np.maximum(mins.max(axis=1), F32(0))
    with np.errstate(divide="ignore"):
        inv_scale = np.where(max_scale > 0, F32(63) / max_scale, F32(0))
        inv_min = np.where(max_min > 0, F32(63) / max_min, F32(0))
    ls = np.minimum(63, nearest_int(inv_scale[:, None] * scales).astype(np.uint8))
    lm = np.minimum(63, nearest_int(inv_min[:, None] * mins).astype(np.uint8))
    d, dmin = _f16(max_scale / F32(63)), _f16(max_min / F32(63))
    dj = d[:, None] * ls.astype(F32)  # get_scale_min_k4 reads back exactly ls and lm
    dmj = dmin[:, None] * lm.astype(F32)
    xs = x.reshape(nb, 8, 32)
    with np.errstate(divide="ignore", invalid="ignore"):
        again = np.clip(nearest_int((xs + dmj[..., None]) / dj[..., None]), 0, nmax)
    L = np.where((dj != 0)[..., None], again, L.reshape(nb, 8, 32)).reshape(nb, 256)
    head = np.concatenate([d.astype(np.float16).view(np.uint8).reshape(nb, 2),
                           dmin.astype(np.float16).view(np.uint8).reshape(nb, 2), _scales_mins_k4(ls, lm)], axis=1)
    return head, L.astype(np.uint8)


def q4_k(x: np.ndarray) -> np.ndarray:
    """quantize_row_q4_K_ref over super-blocks x [nb, 256] -> [nb, 144]."""
    head, L = _kx(x, 15, -1.0, 20)
    L = L.reshape(-1, 4, 2, 32)  # 64-value chunks: first 32 in the low nibbles, next 32 in the high
    qs = (L[:, :, 0] | (L[:, :, 1] << 4)).reshape(-1, 128)
    return np.concatenate([head, qs], axis=1)


def q5_k(x: np.ndarray) -> np.ndarray:
    """quantize_row_q5_K_ref over super-blocks x [nb, 256] -> [nb, 176]."""
    head, L = _kx(x, 31, -0.5, 15)
    L = L.reshape(-1, 4, 2, 32)
    qs = ((L[:, :, 0] & 0xF) | ((L[:, :, 1] & 0xF) << 4)).reshape(-1, 128)
    hi = (L >> 4).astype(np.uint8)  # chunk c's first half sets bit 2c of qh[j], its second half bit 2c+1
    qh = np.zeros((L.shape[0], 32), np.uint8)
    for c in range(4):
        qh |= (hi[:, c, 0] << (2 * c)) | (hi[:, c, 1] << (2 * c + 1))
    return np.concatenate([head, qh, qs], axis=1)


def _make_qx_rmse1(x: np.ndarray, nmax: int):
    """make_qx_quants(n=16, nmax, x, L, rmse_type=1, qw=NULL) over rows x [n, 16] -> (scale [n], L [n, 16] in 0..2nmax-1)."""
    n = x.shape[1]
    ax = np.abs(x)
    amax = np.zeros(x.shape[0], F32)
    mx = np.zeros(x.shape[0], F32)
    for i in range(n):  # the first element of largest magnitude, with its sign
        take = ax[:, i] > amax
        amax = np.where(take, ax[:, i], amax)
        mx = np.where(take, x[:, i], mx)
    zero = amax < GROUP_MAX_EPS
    mxs = np.where(zero, F32(1), mx)
    wt = x * x

    def sums(iscale):
        l = np.clip(nearest_int(iscale[:, None] * x), -nmax, nmax - 1)
        lf = l.astype(F32)
        sumlx = np.zeros(x.shape[0], F32)
        suml2 = np.zeros(x.shape[0], F32)
        for i in range(n):
            sumlx = sumlx + wt[:, i] * x[:, i] * lf[:, i]
            suml2 = suml2 + wt[:, i] * lf[:, i] * lf[:, i]
        return l, sumlx, suml2

    L, sumlx, suml2 = sums(F32(-nmax) / mxs)
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(suml2 != 0, sumlx / suml2, F32(0))
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        l, slx, sl2 = sums(-(F32(nmax) + F32(0.1) * F32(step)) / mxs)
        better = (sl2 > 0) & (slx * slx > best * sl2)
        L = np.where(better[:, None], l, L)
        with np.errstate(divide="ignore", invalid="ignore"):
            scale = np.where(better, slx / sl2, scale)
        best = np.where(better, scale * slx, best)
    return np.where(zero, F32(0), scale), np.where(zero[:, None], 0, L + nmax)


def q6_k(x: np.ndarray) -> np.ndarray:
    """quantize_row_q6_K_ref over super-blocks x [nb, 256] -> [nb, 210]."""
    nb = x.shape[0]
    scales, L = _make_qx_rmse1(x.reshape(nb * 16, 16), 32)
    scales, L = scales.reshape(nb, 16), L.reshape(nb, 256)
    abs_s = np.abs(scales)
    max_abs = np.zeros(nb, F32)
    max_scale = np.zeros(nb, F32)
    for ib in range(16):  # the first scale of largest magnitude, with its sign
        take = abs_s[:, ib] > max_abs
        max_abs = np.where(take, abs_s[:, ib], max_abs)
        max_scale = np.where(take, scales[:, ib], max_scale)
    empty = max_abs < GROUP_MAX_EPS
    iscale = F32(-128) / np.where(empty, F32(1), max_scale)
    d = _f16(F32(1) / iscale)
    sc = np.minimum(127, nearest_int(iscale[:, None] * scales)).astype(np.int8)
    dj = d[:, None] * sc.astype(F32)
    xs = x.reshape(nb, 16, 16)
    with np.errstate(divide="ignore", invalid="ignore"):
        again = np.clip(nearest_int(xs / dj[..., None]), -32, 31) + 32
    L = np.where((dj != 0)[..., None], again, L.reshape(nb, 16, 16)).reshape(nb, 2, 4, 32).astype(np.uint8)
    ql = np.concatenate([(L[:, :, 0] & 0xF) | ((L[:, :, 2] & 0xF) << 4),
                         (L[:, :, 1] & 0xF) | ((L[:, :, 3] & 0xF) << 4)], axis=2).reshape(nb, 128)
    qh = ((L[:, :, 0] >> 4) | ((L[:, :, 1] >> 4) << 2) | ((L[:, :, 2] >> 4) << 4) | ((L[:, :, 3] >> 4) << 6)).reshape(nb, 64)
    out = np.concatenate([ql, qh, sc.view(np.uint8), d.astype(np.float16).view(np.uint8).reshape(nb, 2)], axis=1)
    out[empty] = 0  # memset, d = +0
    return out


QUANTIZERS = {"Q4_K": q4_k, "Q5_K": q5_k, "Q6_K": q6_k}


def quantize(w: np.ndarray, kind: str) -> np.ndarray:
    """A float32 [rows, cols] weight (cols whole 256-value blocks) -> uint8 [rows, cols/256 * bytes]."""
    w = np.ascontiguousarray(w, F32)
    rows, cols = w.shape
    blocks = QUANTIZERS[kind](w.reshape(-1, QK_K))
    return blocks.reshape(rows, cols // QK_K * BLOCK_BYTES[kind])
