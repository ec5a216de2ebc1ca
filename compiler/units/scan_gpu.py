"""The selective scan's CUDA kernels: the math and the shared pieces are scan_kernels.py's.
One thread per channel, the M states unrolled into registers; the backward's channel sums
reduced over a warp with shuffles (butterfly)."""
from __future__ import annotations

from lorac.graphs.ops.scan import ScanDims

from .scan_kernels import GPU_UNROLL, WARP, Emit, backward_args, forward_args, partials


def forward_gpu(d: ScanDims, in_dtype: str):
    """(u, dt, A, Bm, Cm, D) -> (y, hs). One thread per (b, i), blocks of a warp's 32
    channels; the M states unrolled into registers; Bm_t, Cm_t are one address per warp."""
    from tvm.script.ir_builder import IRBuilder
    from tvm.script.ir_builder import tirx as T

    B, S, I, M, L, C = d.batch, d.seq, d.channels, d.state, d.chunk, d.n_chunks
    P = partials(d, gpu=True)
    e = Emit(in_dtype, gpu=True)
    with IRBuilder() as ib:
        with T.prim_func():
            u, dt, A, Bm, Cm, Dv, y, hs = forward_args(e, d, in_dtype)
            with T.launch_thread("blockIdx.x", B * P) as bx, T.launch_thread("threadIdx.x", WARP) as lane:
                b, i = bx // P, bx % P * WARP + lane
                with e.when(i < I, I % WARP != 0):
                    h, a_i = e.local(M), e.local(M)
                    for m in range(M):
                        e.store(h, e.zero(), m)
                        e.store(a_i, A[i, m], m)
                    with T.serial(0, C) as c:
                        for m in range(M):
                            e.store(hs, h[m], b, c, i, m)
                        with T.serial(0, L, unroll=GPU_UNROLL) as tt:
                            t = c * L + tt
                            with e.when(t < S, S % L != 0):
                                dtv, uv = e.load(dt, b, t, i), e.load(u, b, t, i)
                                for m in range(M):
                                    e.store(h, e.exp(dtv * a_i[m]) * h[m] + dtv * uv * e.load(Bm, b, t, m), m)
                                out = Dv[i] * uv
                                for m in range(M):
                                    out = out + h[m] * e.load(Cm, b, t, m)
                                e.store(y, out, b, t, i)
    return ib.get()


def backward_gpu(d: ScanDims, in_dtype: str):
    """(dy, u, dt, A, Bm, Cm, D, hs) -> (du, ddt, dBm partials, dCm partials [B, P, S, M]).
    One thread per (b, i) as in the forward; each warp reduces its 32 channels' dBm_t, dCm_t
    (2M values a step) with a butterfly reduce-scatter: at the shuffle of distance o every
    lane keeps half of its values (the upper half where its bit o is set), adds its
    partner's copy of that half and sends the other, so 2M = 32 sums take 31 shuffles and
    lane k ends up holding sum number k (one store per lane)."""
    from tvm import tirx
    from tvm.script.ir_builder import IRBuilder
    from tvm.script.ir_builder import tirx as T

    B, S, I, M, L, C = d.batch, d.seq, d.channels, d.state, d.chunk, d.n_chunks
    P = partials(d, gpu=True)
    e = Emit(in_dtype, gpu=True)
    NV = 1
    while NV < 2 * M:
        NV *= 2
    with IRBuilder() as ib:
        with T.prim_func():
            dy, u, dt, A, Bm, Cm, Dv, hs, du, ddt, dBp, dCp = backward_args(e, d, in_dtype, P)
            with T.launch_thread("blockIdx.x", B * P) as bx, T.launch_thread("threadIdx.x", WARP) as lane:
                b, grp = bx // P, bx % P
                i = grp * WARP + lane
                valid = i < I
                ic = tirx.min(i, I - 1)  # lanes past I compute with dy = 0: zero contributions
                g, a_i, h = e.local(M), e.local(M), e.local(M)
                hprev, v, s, a = e.local(L * M), e.local(NV), e.local(2), e.local(1)
                for m in range(M):
                    e.store(g, e.zero(), m)
                    e.store(a_i, A[ic, m], m)
                with T.serial(0, C) as cr:
                    c = C - 1 - cr
                    for m in range(M):
                        e.store(h, hs[b, c, ic, m], m)
                    with T.serial(0, L, unroll=GPU_UNROLL) as tt:  # recompute the chunk's states
                        t = c * L + tt
                        with e.when(t < S, S % L != 0):
                            dtv, uv = e.load(dt, b, t, ic), e.load(u, b, t, ic)
                            for m in range(M):
                                e.store(hprev, h[m], tt * M + m)
                                e.store(h, e.exp(dtv * a_i[m]) * h[m] + dtv * uv * e.load(Bm, b, t, m), m)
                    with T.serial(0, L) as tr:  # then walk it backwards
                        tt = L - 1 - tr
                        t = c * L + tt
                        with e.when(t < S, S % L != 0):
                            dtv, uv = e.load(dt, b, t, ic), e.load(u, b, t, ic)
                            dyv = tirx.Select(valid, e.load(dy, b, t, ic), e.zero())
                            xb = dtv * uv
                            e.store(s, e.zero(), 0)
                            e.store(s, e.zero(), 1)
                            for m in range(M):
                                hp, bm = hprev[tt * M + m], e.load(Bm, b, t, m)
                                e.store(a, e.exp(dtv * a_i[m]), 0)
                                e.store(g, dyv * e.load(Cm, b, t, m) + g[m], m)
                                e.store(v, g[m] * xb, m)
                                e.store(v, dyv * (a[0] * hp + xb * bm), M + m)
                                e.store(s, s[0] + g[m] * bm, 0)
                                e.store(s, s[1] + g[m] * a_i[m] * a[0] * hp, 1)
                                e.store(g, g[m] * a[0], m)
                            for k in range(2 * M, NV):
                                e.store(v, e.zero(), k)
                            with e.when(valid, I % WARP != 0):
                                e.store(du, dtv * s[0] + Dv[ic] * dyv, b, t, ic)
                                e.store(ddt, uv * s[0] + s[1], b, t, ic)
                            sums, base, owner = _warp_reduce(e, v, NV, lane)
                            with e.when(owner, NV < WARP):
                                for k, total in enumerate(sums):
                                    idx = base + k
                                    with T.If(idx < M):
                                        with T.Then():
                                            e.store(dBp, total, b, grp, t, idx)
                                        with T.Else():
                                            with e.when(idx < 2 * M, NV > 2 * M):
                                                e.store(dCp, total, b, grp, t, idx - M)
    return ib.get()


def butterfly(v: list, lane_bit, select, shuffle, commit):
    """Butterfly reduce-scatter of the values v (a power-of-two count; one copy per lane) over
    the 32 lanes of a warp, written against a tiny interface so that tests can run it on numpy
    lanes: lane_bit(o) whether the lane's bit o is set, select(c, a, b), shuffle(x, o) the
    value of lane ^ o, commit(values) -> values as stored (TIR: into a local array).
    -> (sums, base, spread): v[k] on a lane is sum number base + k; lanes differing only in the
    bits of `spread` hold the same sums (fewer values than lanes)."""
    n, base, spread = len(v), 0, []
    o = WARP // 2
    while o >= 1:
        upper = lane_bit(o)
        if n >= 2:
            half = n // 2
            # keep the upper half where bit o is set, send the other half to lane ^ o
            v = commit([select(upper, v[k + half], v[k]) + shuffle(select(upper, v[k], v[k + half]), o)
                        for k in range(half)])
            base = base + select(upper, half, 0)
            n = half
        else:  # one value left: the rest is a plain all-reduce
            v = commit([v[0] + shuffle(v[0], o)])
            spread.append(o)
        o //= 2
    return v, base, spread


def _warp_reduce(e, v, NV: int, lane):
    """butterfly() in TIR over the local array v[0:NV]. -> (sums, base, owner), owner: the
    lanes that write the sums."""
    from tvm import tirx

    full = tirx.const(0xFFFFFFFF, "uint32")

    def commit(values):
        for k, x in enumerate(values):
            e.store(v, x, k)
        return [v[k] for k in range(len(values))]

    sums, base, spread = butterfly(
        [v[k] for k in range(NV)], lambda o: tirx.bitwise_and(lane, o) != 0, tirx.Select,
        lambda x, o: tirx.op.tvm_warp_shuffle_xor(full, x, o, WARP, WARP), commit)
    owner = tirx.const(True, "bool")
    for o in spread:
        owner = tirx.all(owner, tirx.bitwise_and(lane, o) == 0)
    return sums, base, owner
