"""The selective scan as two TVM kernels (TIR prim_funcs), one per direction, for the CPU
(LLVM) and for CUDA: what the SelectiveScan / SelectiveScanGrad units become on those
targets (compiler/units/scan.py).

Shape legend: B batch, S seq, I channels, M state size, L chunk, C = ceil(S / L) chunks,
P channel groups (partial sums, below). u, dt, dy, y [B, S, I]; A [I, M] (< 0); Bm, Cm
[B, S, M]; D [I]; hs [B, C, I, M], the state entering each chunk.

Each (batch row b, channel i) is one independent recurrence over time, walked in order
with its state h [M] in registers (a vector register on the CPU: the M states are the
SIMD lanes; on a GPU one thread per channel, the M states unrolled):

    forward    a_t = exp(dt_t A_i)                h_t = a_t h_{t-1} + dt_t u_t Bm_t
               y_t = <Cm_t, h_t> + D_i u_t         hs_c = h_{cL-1} (the state entering chunk c)

    backward   chunks last to first; per chunk, recompute a_t and h_{t-1} for its L steps from
               hs_c (L x M values in local memory: never the [B, S, I, M] states), then t from
               the chunk's last step to its first, with g_t = dL/dh_t carried in registers:
               g_t   = dy_t Cm_t + a_{t+1} g_{t+1}
               du_t  = dt_t <g_t, Bm_t> + D_i dy_t
               ddt_t = u_t <g_t, Bm_t> + <g_t, A_i a_t h_{t-1}>      (d h_t / d dt_t = A a_t h_{t-1} + u_t Bm_t)
               dBm_t += dt_t u_t g_t,    dCm_t += dy_t h_t           (sums over the channels i)

The channel sums dBm, dCm are reduced inside the kernel over a group of channels and written
as partials [B, P, S, M], which the caller sums over P (a plain reduction kernel): on the
CPU a group is the channels one parallel task walks, on CUDA the 32 channels of a warp,
reduced with shuffles. A and D are frozen in LoRA training (A_log, D get no gradient), so
their gradients are not formed.

Inputs may be bf16 (or fp64 for float64 graphs); states, sums and outputs are fp32 (fp64).
On the CPU exp is a Cody-Waite + Cephes polynomial in plain arithmetic, which LLVM
vectorizes (libm's expf does not); its exponent is <= 0 here (dt > 0, A < 0).
"""
from __future__ import annotations

import contextlib

from lorac.graphs.scan import ScanDims

CPU_GROUP = 16  # channels a CPU task advances together, one after another, at each step
CPU_TASKS = 64  # parallel tasks of the CPU backward (each writes a partial of dBm, dCm)
WARP = 32
_UNROLL = 4  # time steps per unrolled body on the GPU: lets the loads of later steps overlap


def cpu_group(d: ScanDims) -> int:
    """G: channels a CPU task advances together at each step (G x M states <= 1 KB: stack)."""
    return max(1, min(d.channels, 256 // d.state, CPU_GROUP))


def cpu_groups(d: ScanDims) -> int:
    return -(-d.channels // cpu_group(d))


def partials(d: ScanDims, gpu: bool) -> int:
    """P: the partial sums of dBm/dCm per batch row the backward writes: one per warp on
    CUDA; on the CPU one per parallel task, about CPU_TASKS tasks in all."""
    if gpu:
        return -(-d.channels // WARP)
    return max(1, min(cpu_groups(d), -(-CPU_TASKS // d.batch)))


def accumulator(in_dtype: str) -> str:
    return "float64" if in_dtype == "float64" else "float32"


# -- expression helpers ---------------------------------------------------------------------
def _exp_cpu(x, acc: str):
    """exp(x) for x <= 0 (clamped to fp32's normal range) in vectorizable arithmetic:
    x = n ln2 + r with |r| <= ln2/2 (ln2 split in two, Cody-Waite), exp(r) by the Cephes
    degree-7 polynomial, 2^n by writing n into the exponent bits. ~1e-7 relative."""
    from tvm import tirx

    if acc == "float64":
        return tirx.exp(x)
    f = lambda v: tirx.const(v, "float32")
    x = tirx.max(tirx.min(x, f(0.0)), f(-87.3))
    n = tirx.floor(x * f(1.4426950408889634) + f(0.5))
    r = (x - n * f(0.693359375)) - n * f(-2.12194440e-4)
    p = f(1.9875691500e-4)
    for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        p = p * r + f(c)
    p = p * r * r + r + f(1.0)
    two_n = tirx.reinterpret("float32", tirx.shift_left(tirx.Cast("int32", n) + 127, 23))
    return p * two_n


def _exp_gpu(x, acc: str):
    from tvm import tirx
    if acc == "float64":
        return tirx.exp(x)
    return tirx.exp2(x * tirx.const(1.4426950408889634, "float32"))  # ex2.approx underneath


class _Emit:
    """IRBuilder shorthands shared by the four kernels."""

    def __init__(self, in_dtype: str, gpu: bool):
        from tvm import tirx
        from tvm.script.ir_builder import tirx as T
        self.T, self.tirx, self.acc, self.gpu = T, tirx, accumulator(in_dtype), gpu

    def arg(self, name, shape, dtype):
        return self.T.arg(name, self.T.buffer(tuple(shape), dtype))

    def local(self, n, dtype=None):
        """A small per-thread array: registers or the stack. (On the CPU TVM 0.27 turns scope
        "local" into a heap workspace per allocation; "global" of <= 1 KB is a stack alloca.)"""
        return self.T.alloc_buffer((n,), dtype or self.acc, scope="local" if self.gpu else "global")

    def load(self, buf, *idx):
        """buf[idx] widened to the accumulator type."""
        v = buf[idx]
        return v if buf.dtype == self.acc else self.tirx.Cast(self.acc, v)

    def zero(self):
        return self.tirx.const(0.0, self.acc)

    def store(self, buf, value, *idx):
        self.T.buffer_store(buf, value, list(idx))

    def exp(self, x):
        return (_exp_gpu if self.gpu else _exp_cpu)(x, self.acc)

    @contextlib.contextmanager
    def channels(self, G: int, i0, I: int):
        """for j in range(G): with i = i0 + j < I: yields (j, i)."""
        with self.T.serial(0, G) as j:
            with self.when(i0 + j < I, I % G != 0):
                yield j, i0 + j

    @contextlib.contextmanager
    def when(self, cond, needed: bool = True):
        """`if cond:` around the body, or nothing when the condition always holds."""
        if not needed:
            yield
            return
        with self.T.If(cond):
            with self.T.Then():
                yield

    def hsum(self, *bufs, n: int):
        """In place: bufs[k][0] = sum(bufs[k][:n]) as a tree of vector adds (log2 n dependent
        steps instead of n), the k buffers in the same loops."""
        T = self.T
        w = 1
        while 2 * w <= n:
            w *= 2
        if w < n:  # fold the tail onto the power-of-two head
            with T.vectorized(0, n - w) as k:
                for b in bufs:
                    self.store(b, b[k] + b[k + w], k)
        while w > 1:
            w //= 2
            with T.vectorized(0, w) as k:
                for b in bufs:
                    self.store(b, b[k] + b[k + w], k)


def _scan_inputs(e, d: ScanDims, in_dtype: str):
    """Inside `T.prim_func()`: the function's attributes, then the six scan inputs as kernel
    arguments: u, dt [B, S, I], A [I, M], Bm, Cm [B, S, M], D [I]."""
    _prim_func()
    B, S, I, M = d.batch, d.seq, d.channels, d.state
    u, dt = e.arg("u", (B, S, I), in_dtype), e.arg("dt", (B, S, I), in_dtype)
    A = e.arg("A", (I, M), e.acc)
    Bm, Cm = e.arg("Bm", (B, S, M), in_dtype), e.arg("Cm", (B, S, M), in_dtype)
    return u, dt, A, Bm, Cm, e.arg("D", (I,), e.acc)


def _forward_args(e, d: ScanDims, in_dtype: str):
    """The forward kernel's arguments: the inputs, then y [B, S, I] and hs [B, C, I, M]."""
    B, S, I, M, C = d.batch, d.seq, d.channels, d.state, d.n_chunks
    return (*_scan_inputs(e, d, in_dtype), e.arg("y", (B, S, I), e.acc), e.arg("hs", (B, C, I, M), e.acc))


def _backward_args(e, d: ScanDims, in_dtype: str, P: int):
    """The backward kernel's arguments: dy, the inputs, hs; then du, ddt [B, S, I] and the
    dBm, dCm partials [B, P, S, M]."""
    B, S, I, M, C = d.batch, d.seq, d.channels, d.state, d.n_chunks
    dy = e.arg("dy", (B, S, I), in_dtype)
    inputs = _scan_inputs(e, d, in_dtype)
    hs = e.arg("hs", (B, C, I, M), e.acc)
    return (dy, *inputs, hs, e.arg("du", (B, S, I), e.acc), e.arg("ddt", (B, S, I), e.acc),
            e.arg("dBm_part", (B, P, S, M), e.acc), e.arg("dCm_part", (B, P, S, M), e.acc))


def _prim_func():
    from tvm.script.ir_builder import tirx as T
    # scheduled here: DLight and lorac's CPU rules leave it alone; no aliasing between buffers.
    # No global symbol: the module it joins names it (BlockBuilder.add_func).
    T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})


# -- CPU ----------------------------------------------------------------------------------
def forward_cpu(d: ScanDims, in_dtype: str):
    """(u, dt, A, Bm, Cm, D) -> (y, hs). One parallel task per (b, group of G channels); the
    M states are the vector lanes; at each step the task advances its G channels one after
    another (G independent recurrences in flight, and u, dt, y read and written in runs of
    G contiguous values); y's sum over M is a tree of vector adds."""
    from tvm.script.ir_builder import IRBuilder
    from tvm.script.ir_builder import tirx as T

    B, S, I, M, L, C = d.batch, d.seq, d.channels, d.state, d.chunk, d.n_chunks
    G, n_groups = cpu_group(d), cpu_groups(d)
    e = _Emit(in_dtype, gpu=False)
    with IRBuilder() as ib:
        with T.prim_func():
            u, dt, A, Bm, Cm, Dv, y, hs = _forward_args(e, d, in_dtype)
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
    e = _Emit(in_dtype, gpu=False)
    with IRBuilder() as ib:
        with T.prim_func():
            dy, u, dt, A, Bm, Cm, Dv, hs, du, ddt, dBp, dCp = _backward_args(e, d, in_dtype, P)
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


# -- CUDA -----------------------------------------------------------------------------------
def forward_gpu(d: ScanDims, in_dtype: str):
    """(u, dt, A, Bm, Cm, D) -> (y, hs). One thread per (b, i), blocks of a warp's 32
    channels; the M states unrolled into registers; Bm_t, Cm_t are one address per warp."""
    from tvm.script.ir_builder import IRBuilder
    from tvm.script.ir_builder import tirx as T

    B, S, I, M, L, C = d.batch, d.seq, d.channels, d.state, d.chunk, d.n_chunks
    P = partials(d, gpu=True)
    e = _Emit(in_dtype, gpu=True)
    with IRBuilder() as ib:
        with T.prim_func():
            u, dt, A, Bm, Cm, Dv, y, hs = _forward_args(e, d, in_dtype)
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
                        with T.serial(0, L, unroll=_UNROLL) as tt:
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
    e = _Emit(in_dtype, gpu=True)
    NV = 1
    while NV < 2 * M:
        NV *= 2
    with IRBuilder() as ib:
        with T.prim_func():
            dy, u, dt, A, Bm, Cm, Dv, hs, du, ddt, dBp, dCp = _backward_args(e, d, in_dtype, P)
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
                    with T.serial(0, L, unroll=_UNROLL) as tt:  # recompute the chunk's states
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
