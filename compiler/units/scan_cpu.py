"""The selective scan's CPU kernels (LLVM): the math and the shared pieces are
scan_kernels.py's. The M states of a channel are the vector lanes; a parallel task walks a
group of channels."""
from __future__ import annotations

from lorac.graphs.ops.scan import ScanDims

from .scan_kernels import Emit, backward_args, cpu_group, cpu_groups, forward_args, partials


def forward_cpu(d: ScanDims, in_dtype: str):
    """(u, dt, A, Bm, Cm, D) -> (y, hs). One parallel task per (b, group of G channels); the
    M states are the vector lanes; at each step the task advances its G channels one after
    another (G independent recurrences in flight, and u, dt, y read and written in runs of
    G contiguous values); y's sum over M is a tree of vector adds."""
    from tvm.script.ir_builder import IRBuilder
    from tvm.script.ir_builder import tirx as T

    B, S, I, M, L, C = d.batch, d.seq, d.channels, d.state, d.chunk, d.n_chunks
    G, n_groups = cpu_group(d), cpu_groups(d)
    e = Emit(in_dtype, gpu=False)
    with IRBuilder() as ib:
        with T.prim_func():
            u, dt, A, Bm, Cm, Dv, y, hs = forward_args(e, d, in_dtype)
            with T.parallel(0, B * n_groups) as bg:
                b, i0 = bg // n_groups, bg % n_groups * G
                h, a_i, p = e.local(G * M), e.local(G * M), e.local(M)
                with e.channels(G, i0, I) as (j, i):
                    with T.vectorized(0, M) as m:
                        e.store(h, e.zero(), j * M + m)
                        e.store(a_i, A[i, m], j * M + m)
                with T.serial(0, C) as c:
                    with e.channels(G, i0, I) as (j, i):
                        with T.vectorized(0, M) as m:
                            e.store(hs, h[j * M + m], b, c, i, m)
                    with T.serial(0, L) as tt:
                        t = c * L + tt
                        with e.when(t < S, S % L != 0):
                            with e.channels(G, i0, I) as (j, i):
                                dtv, uv = e.load(dt, b, t, i), e.load(u, b, t, i)
                                with T.vectorized(0, M) as m:
                                    k = j * M + m
                                    e.store(h, e.exp(dtv * a_i[k]) * h[k] + dtv * uv * e.load(Bm, b, t, m), k)
                                    e.store(p, h[k] * e.load(Cm, b, t, m), m)
                                e.hsum(p, n=M)
                                e.store(y, p[0] + Dv[i] * uv, b, t, i)
    return ib.get()


def backward_cpu(d: ScanDims, in_dtype: str):
    """(dy, u, dt, A, Bm, Cm, D, hs) -> (du, ddt, dBm partials, dCm partials [B, P, S, M]).
    One parallel task per (b, p): it walks its groups of G channels one after another, each
    group as in the forward (its G channels interleaved at every step), so at each step the
    group's dBm_t, dCm_t are vector sums over its channels, added to the task's partial."""
    from tvm.script.ir_builder import IRBuilder
    from tvm.script.ir_builder import tirx as T

    B, S, I, M, L, C = d.batch, d.seq, d.channels, d.state, d.chunk, d.n_chunks
    G, n_groups, P = cpu_group(d), cpu_groups(d), partials(d, gpu=False)
    per_task = -(-n_groups // P)
    e = Emit(in_dtype, gpu=False)
    with IRBuilder() as ib:
        with T.prim_func():
            dy, u, dt, A, Bm, Cm, Dv, hs, du, ddt, dBp, dCp = backward_args(e, d, in_dtype, P)
            with T.parallel(0, B * P) as bp:
                b, part = bp // P, bp % P
                with T.serial(0, S) as t:
                    with T.vectorized(0, M) as m:
                        e.store(dBp, e.zero(), b, part, t, m)
                        e.store(dCp, e.zero(), b, part, t, m)
                h, g, a_i = e.local(G * M), e.local(G * M), e.local(G * M)
                w1, w2, sum_b, sum_c = e.local(M), e.local(M), e.local(M), e.local(M)
                hprev, decay = e.local(L * G * M), e.local(L * G * M)  # the chunk's h_{t-1} and a_t
                with T.serial(0, per_task) as q:
                    grp = part * per_task + q
                    i0 = grp * G
                    with e.when(grp < n_groups, n_groups % P != 0):
                        with e.channels(G, i0, I) as (j, i):
                            with T.vectorized(0, M) as m:
                                e.store(g, e.zero(), j * M + m)
                                e.store(a_i, A[i, m], j * M + m)
                        with T.serial(0, C) as cr:
                            c = C - 1 - cr
                            with e.channels(G, i0, I) as (j, i):
                                with T.vectorized(0, M) as m:
                                    e.store(h, hs[b, c, i, m], j * M + m)
                            with T.serial(0, L) as tt:  # recompute the chunk's states
                                t = c * L + tt
                                with e.when(t < S, S % L != 0):
                                    with e.channels(G, i0, I) as (j, i):
                                        dtv, uv = e.load(dt, b, t, i), e.load(u, b, t, i)
                                        with T.vectorized(0, M) as m:
                                            k, kt = j * M + m, (tt * G + j) * M + m
                                            a = e.exp(dtv * a_i[k])
                                            e.store(decay, a, kt)
                                            e.store(hprev, h[k], kt)
                                            e.store(h, a * h[k] + dtv * uv * e.load(Bm, b, t, m), k)
                            with T.serial(0, L) as tr:  # then walk it backwards
                                tt = L - 1 - tr
                                t = c * L + tt
                                with e.when(t < S, S % L != 0):
                                    with T.vectorized(0, M) as m:
                                        e.store(sum_b, e.zero(), m)
                                        e.store(sum_c, e.zero(), m)
                                    with e.channels(G, i0, I) as (j, i):
                                        dtv, uv, dyv = e.load(dt, b, t, i), e.load(u, b, t, i), e.load(dy, b, t, i)
                                        xb = dtv * uv
                                        with T.vectorized(0, M) as m:
                                            k, kt = j * M + m, (tt * G + j) * M + m
                                            a, hp, bm = decay[kt], hprev[kt], e.load(Bm, b, t, m)
                                            gm = dyv * e.load(Cm, b, t, m) + g[k]
                                            e.store(sum_c, sum_c[m] + dyv * (a * hp + xb * bm), m)
                                            e.store(sum_b, sum_b[m] + gm * xb, m)
                                            e.store(w1, gm * bm, m)
                                            e.store(w2, gm * a_i[k] * a * hp, m)
                                            e.store(g, gm * a, k)
                                        e.hsum(w1, w2, n=M)
                                        e.store(du, dtv * w1[0] + Dv[i] * dyv, b, t, i)
                                        e.store(ddt, uv * w1[0] + w2[0], b, t, i)
                                    with T.vectorized(0, M) as m:
                                        e.store(dBp, dBp[b, part, t, m] + sum_b[m], b, part, t, m)
                                        e.store(dCp, dCp[b, part, t, m] + sum_c[m], b, part, t, m)
    return ib.get()
