"""The LoRA+ AdamW step as an ONNX graph, compiled for the device like the training step.

Inputs  per bucket k (see Bucket): k.param, k.m, k.v, k.grad   float32 [size], flat
        lr_a, lr_b, step                                     float32 scalars
Outputs per bucket k: k.param.new, k.m.new, k.v.new
        grad_norm (float32 scalar, before clipping), skipped (float32 scalar, 1.0 or 0.0)

Learning rates and the 1-based step count are inputs, so a schedule never recompiles;
betas, eps, weight decay and max_grad_norm are baked in as constants. The math is the
numpy reference's (lorac.runtime.train.optim, the test oracle; both take the LoRA+ group rule
from lorac.core.loraplus):
    norm = sqrt(sum_n sum(g_n^2));  ok = norm is finite
    c    = min(1, max_grad_norm / (norm + 1e-6))          (c = 1 without clipping)
    m'   = b1 m + (1-b1) c g;  v' = b2 v + (1-b2) (c g)^2
    p'   = p - lr * ((m'/(1-b1^t)) / (sqrt(v'/(1-b2^t)) + eps) + wd p)
    out  = ok ? (p', m', v') : (p, m, v)                  a NaN/Inf step changes nothing
Where() picks per element and does not propagate NaN from the branch it drops, so the
skipped case returns the inputs bit for bit. The caller must not advance `step` then.

Ops: Mul, Add, Sub, Div, Neg, Sqrt, Exp, Less, Min, ReduceSum, Reshape, IsNaN, IsInf, Or, Not, Where,
Cast, Identity: default domain only, all in TVM 0.27's ONNX frontend map. Each bucket's
update is a unit (AdamWStep, a local function of those ops): a compiler may run it as one
kernel that updates p, m and v in place (CUDA: compiler/units/adamw.py). Reductions keep
dims and end at shape [1] (DLight's GPU reduction rule crashed on a 0-d result with a fused
epilogue, see NOTES); the scalar outputs are reshaped to [] at the very end.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import onnx

from lorac.core.loraplus import decays, group_of

from .builder import GraphBuilder


@dataclass
class Bucket:
    """LoRA tensors sharing a learning rate and a decay rule, stored as ONE flat vector.

    The runtime keeps each bucket's params, m and v as flat device buffers and hands the
    training step zero-copy views of the params; the optimizer then runs as a handful of
    kernels over a few flat vectors instead of ~20 small kernels per tensor (the SmolLM2
    adapter has 420 tensors), which also keeps its compile time to seconds.
    """
    key: str  # "lora_A", "lora_B" (+ ".nodecay" for 1-D tensors)
    group: str  # "A" or "B": lr_a or lr_b
    decay: bool
    entries: list = field(default_factory=list)  # (name, offset, shape), in the shapes' order
    size: int = 0


def buckets(shapes: dict[str, tuple[int, ...]]) -> list[Bucket]:
    out: dict[str, Bucket] = {}
    for name, shape in shapes.items():
        grp, dec = group_of(name, len(shape)), decays(name, len(shape))
        key = f"lora_{grp}" + ("" if dec else ".nodecay")
        b = out.setdefault(key, Bucket(key, grp, dec))
        n = int(np.prod(shape))
        b.entries.append((name, b.size, tuple(shape)))
        b.size += n
    return list(out.values())


def pack(bks: list[Bucket], tensors: dict) -> dict[str, np.ndarray]:
    """{bucket key: flat float32 vector} from per-tensor arrays."""
    return {b.key: np.concatenate([np.asarray(tensors[n], np.float32).reshape(-1) for n, _, _ in b.entries])
            for b in bks}


def unpack(bks: list[Bucket], flats: dict) -> dict[str, np.ndarray]:
    """Per-tensor views into flat vectors (inverse of pack)."""
    return {n: flats[b.key][off:off + int(np.prod(s))].reshape(s) for b in bks for n, off, s in b.entries}


def build_optimizer_graph(shapes: dict[str, tuple[int, ...]], cfg) -> onnx.ModelProto:
    """LoRA+ AdamW over the tensors in `shapes` (name -> shape); `cfg` gives the constants baked
    in (betas, eps, weight_decay, max_grad_norm: lorac.core.loraplus.AdamWConstants, or a
    runtime LoraPlusConfig, which has them too).

    Inputs: per bucket `<key>.param`, `<key>.grad`, `<key>.m`, `<key>.v` (flat [size]);
    `lr_a`, `lr_b`, `step`. Outputs: `<key>.param.new`, `<key>.m.new`, `<key>.v.new`,
    `grad_norm`, `skipped`. The runtime copies the step's per-tensor gradients into views
    of the flat `<key>.grad` buffer on the device: a Concat of hundreds of inputs in the
    graph compiled into one kernel with a chain of hundreds of branches per element (69 s
    of TVM build for the SmolLM2 adapter).
    """
    if not shapes or any(len(s) == 0 for s in shapes.values()):
        raise ValueError("build_optimizer_graph: needs at least one tensor, none of them 0-d")
    b1, b2 = (float(b) for b in cfg.betas)
    g = GraphBuilder("lorac_loraplus_adamw")
    g.scope = "adamw"
    bks = buckets(shapes)
    p_in = {b.key: g.input(f"{b.key}.param", [b.size]) for b in bks}
    m_in = {b.key: g.input(f"{b.key}.m", [b.size]) for b in bks}
    v_in = {b.key: g.input(f"{b.key}.v", [b.size]) for b in bks}
    flat = {b.key: g.input(f"{b.key}.grad", [b.size]) for b in bks}
    lr_a, lr_b, step = g.input("lr_a", []), g.input("lr_b", []), g.input("step", [])
    # global norm: each bucket's sum of squares reduced to [1], then summed
    sq = [_sum_squares(g, flat[b.key], b.size) for b in bks]
    total = sq[0] if len(sq) == 1 else g.op("Sum", *sq)
    norm = g.op("Sqrt", total)  # [1]
    ok = g.op("Not", g.op("Or", g.op("IsNaN", norm), g.op("IsInf", norm)))  # [1] bool

    # clip factor c = min(1, max_norm / (norm + 1e-6)), torch's clip_grad_norm_ form
    if cfg.max_grad_norm and cfg.max_grad_norm > 0:
        c = g.op("Min", g.f(1.0), g.op("Div", g.f(cfg.max_grad_norm), g.op("Add", norm, g.f(1e-6))))
    else:
        c = g.f(1.0)  # no clipping: x * 1 is x

    # bias corrections, shared by every tensor: 1 - beta^t with t the float step input
    bc1, bc2 = _one_minus_pow(g, b1, step), _one_minus_pow(g, b2, step)

    consts = [g.f(x) for x in (b1, 1.0 - b1, b2, 1.0 - b2, cfg.eps)]
    for b in bks:
        lr = lr_b if b.group == "B" else lr_a
        wd = g.f(cfg.weight_decay if b.decay else 0.0)
        ins = [p_in[b.key], m_in[b.key], v_in[b.key], flat[b.key], c, ok, lr, bc1, bc2, *consts, wd]
        new = g.call(ADAMW_STEP, g.np_float.name, ins, 3, _adamw_body)
        for value, what in zip(new, ("param", "m", "v")):
            g.output(value, f"{b.key}.{what}.new")

    scalar = g.const(np.zeros(0, np.int64))  # Reshape to shape [] (a 0-d tensor)
    g.output(g.op("Reshape", norm, scalar), "grad_norm")
    skipped = g.op("Cast", g.op("Not", ok), to=1)  # to=1: FLOAT
    g.output(g.op("Reshape", skipped, scalar), "skipped")
    doc = (f"LoRA+ AdamW: betas=({b1}, {b2}) eps={cfg.eps} weight_decay={cfg.weight_decay} "
           f"max_grad_norm={cfg.max_grad_norm}; lr_a, lr_b, step are inputs")
    return g.finish(doc, data_prop=False)  # flat vectors: builder.finish says why


ADAMW_STEP = "AdamWStep"  # a unit: CUDA updates p, m, v in place (compiler/units/adamw.py)


def _adamw_body(g, p, m, v, grad, c, ok, lr, bc1, bc2, b1, one_b1, b2, one_b2, eps, wd):
    """One bucket's update: (p, m, v) -> (p', m', v'), the inputs again where not `ok`. The
    constants are inputs so one body serves every bucket (weight decay 0 for 1-D tensors)."""
    grad = g.op("Mul", grad, c)
    m1 = g.op("Add", g.op("Mul", b1, m), g.op("Mul", one_b1, grad))
    v1 = g.op("Add", g.op("Mul", b2, v), g.op("Mul", one_b2, g.op("Mul", grad, grad)))
    mhat = g.op("Div", m1, bc1)
    denom = g.op("Add", g.op("Sqrt", g.op("Div", v1, bc2)), eps)
    upd = g.op("Add", g.op("Div", mhat, denom), g.op("Mul", wd, p))  # decoupled: decay acts on p, not on g
    p1 = g.op("Sub", p, g.op("Mul", lr, upd))
    return g.op("Where", ok, p1, p), g.op("Where", ok, m1, m), g.op("Where", ok, v1, v)


def _row_length(size: int, most: int = 4096) -> int:
    """The largest power of two <= `most` that divides `size` (1 if it is odd)."""
    k = 1
    while k < most and size % (2 * k) == 0:
        k *= 2
    return k


def _sum_squares(g: GraphBuilder, x, size: int):
    """sum(x^2) of a flat [size] vector -> [1], in two stages: rows of up to 4096 elements
    (one GPU block each), then their sums. One reduction over the whole vector is one thread
    block on a GPU: for a Llama-3-8B adapter's 21M-element buckets that took 3 of the update's
    4 ms on the H200."""
    k = _row_length(size)
    if k < 64 or size // k < 2:
        return g.reduce_sum(g.op("Mul", x, x), 0)
    rows = g.reshape(x, size // k, k)  # a view; the square fuses into the row sums
    return g.reduce_sum(g.reduce_sum(g.op("Mul", rows, rows), 1, keepdims=0), 0)


SERIES_BELOW = 1.0  # |q| under which expm1(q) is its Taylor series (_one_minus_pow)
SERIES_TERMS = 13  # q^14/14! < 1.2e-11 relative at |q| = 1


def _one_minus_pow(g: GraphBuilder, b: float, t):
    """1 - b^t, accurate in float32 also where b^t is close to 1, on any device: only Exp,
    Mul, Add and selects, no Log.

    The plain form cancels: in float32, 1 - 0.999**1 = 0.00099998713 (1.3e-5 relative
    error, 6e-6 after the sqrt), i.e. the first updates would be off by 6e-6. So it is
    -expm1(q) with q = t*ln(b) (ln b taken in float64 and rounded once):
    - |q| < 1: expm1's Taylor series, q(1 + q/2(1 + q/3(1 + ... (1 + q/13)))) in Horner form,
      Mul and Add only (correctly rounded everywhere): a few ulp;
    - q <= -1: u - 1 with u = exp(q) <= 0.37, which does not cancel: exp's error (a few ulp
      of u, more on GPUs: Vulkan allows 3 + 2|q| ulp) stays under 0.6x that relative.
    The previous form, Kahan's (u - 1) q / log(u), needs log(u) to a few ulp relative near 1,
    and GPU logs are specified in absolute error there (Vulkan, so WebGPU: 2^-21 on [0.5, 2]):
    log(0.999) ~ -1e-3 may lose 4.8e-4 of its value, and 1 - b2^t and every update with it
    (on the CPU that reproduces the size of `--target webgpu`'s 20-step drift on the H200:
    docs/BENCHMARKS.md, WebGPU).
    For t = 1..200000, b in (0.5, 0.9, 0.999, 0.99999) on onnxruntime's CPU provider: <= 1.7e-7
    relative; with exp and log as inexact as Vulkan allows, <= 4.5e-7 (Kahan's form: 5e-2).
    tests/test_optim.py, test_bias_correction_*.
    """
    if b == 0.0:
        return g.f(1.0)  # no momentum: 1 - 0^t = 1 for t >= 1
    q = g.op("Mul", t, g.f(math.log(b)))
    far = g.op("Less", q, g.f(-SERIES_BELOW))
    qs = g.op("Where", far, g.f(-SERIES_BELOW), q)  # the series' argument, bounded (its branch is unused there)
    r = g.op("Add", g.f(1.0), g.op("Mul", qs, g.f(1.0 / SERIES_TERMS)))
    for k in range(SERIES_TERMS - 1, 1, -1):
        r = g.op("Add", g.f(1.0), g.op("Mul", g.op("Mul", qs, g.f(1.0 / k)), r))
    series = g.op("Mul", qs, r)
    direct = g.op("Sub", g.op("Exp", q), g.f(1.0))
    em1 = g.op("Where", far, direct, series)
    return g.op("Neg", em1)


def optimizer_feed_names(shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """The graph's input names in order (handy for runtimes that feed positionally)."""
    keys = [b.key for b in buckets(shapes)]
    return ([f"{k}.param" for k in keys] + [f"{k}.m" for k in keys] + [f"{k}.v" for k in keys]
            + [f"{k}.grad" for k in keys] + ["lr_a", "lr_b", "step"])


def optimizer_output_names(shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """The graph's output names in order."""
    out = []
    for b in buckets(shapes):
        out += [f"{b.key}.param.new", f"{b.key}.m.new", f"{b.key}.v.new"]
    return out + ["grad_norm", "skipped"]
