"""The selective scan as two TVM kernels (TIR prim_funcs), one per direction, for the CPU
(LLVM: scan_cpu.py) and for CUDA (scan_gpu.py): what the SelectiveScan / SelectiveScanGrad
units become on those targets (compiler/units/scan.py). Here: the math, the sizes and the
IRBuilder shorthands the four kernels share.

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

from lorac.graphs.ops.scan import ScanDims

CPU_GROUP = 16  # channels a CPU task advances together, one after another, at each step
CPU_TASKS = 64  # parallel tasks of the CPU backward (each writes a partial of dBm, dCm)
WARP = 32
GPU_UNROLL = 4  # time steps per unrolled body on the GPU: lets the loads of later steps overlap


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
def exp_cpu(x, acc: str):
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


def exp_gpu(x, acc: str):
    from tvm import tirx
    if acc == "float64":
        return tirx.exp(x)
    return tirx.exp2(x * tirx.const(1.4426950408889634, "float32"))  # ex2.approx underneath


class Emit:
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
        return (exp_gpu if self.gpu else exp_cpu)(x, self.acc)

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


def scan_inputs(e, d: ScanDims, in_dtype: str):
    """Inside `T.prim_func()`: the function's attributes, then the six scan inputs as kernel
    arguments: u, dt [B, S, I], A [I, M], Bm, Cm [B, S, M], D [I]."""
    _prim_func()
    B, S, I, M = d.batch, d.seq, d.channels, d.state
    u, dt = e.arg("u", (B, S, I), in_dtype), e.arg("dt", (B, S, I), in_dtype)
    A = e.arg("A", (I, M), e.acc)
    Bm, Cm = e.arg("Bm", (B, S, M), in_dtype), e.arg("Cm", (B, S, M), in_dtype)
    return u, dt, A, Bm, Cm, e.arg("D", (I,), e.acc)


def forward_args(e, d: ScanDims, in_dtype: str):
    """The forward kernel's arguments: the inputs, then y [B, S, I] and hs [B, C, I, M]."""
    B, S, I, M, C = d.batch, d.seq, d.channels, d.state, d.n_chunks
    return (*scan_inputs(e, d, in_dtype), e.arg("y", (B, S, I), e.acc), e.arg("hs", (B, C, I, M), e.acc))


def backward_args(e, d: ScanDims, in_dtype: str, P: int):
    """The backward kernel's arguments: dy, the inputs, hs; then du, ddt [B, S, I] and the
    dBm, dCm partials [B, P, S, M]."""
    B, S, I, M, C = d.batch, d.seq, d.channels, d.state, d.n_chunks
    dy = e.arg("dy", (B, S, I), in_dtype)
    inputs = scan_inputs(e, d, in_dtype)
    hs = e.arg("hs", (B, C, I, M), e.acc)
    return (dy, *inputs, hs, e.arg("du", (B, S, I), e.acc), e.arg("ddt", (B, S, I), e.acc),
            e.arg("dBm_part", (B, P, S, M), e.acc), e.arg("dCm_part", (B, P, S, M), e.acc))


def _prim_func():
    from tvm.script.ir_builder import tirx as T
    # scheduled here: DLight and lorac's CPU rules leave it alone; no aliasing between buffers.
    # No global symbol: the module it joins names it (BlockBuilder.add_func).
    T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
