"""Mamba-1 (HF `MambaForCausalLM`): one ONNX graph for the loss and every LoRA gradient.

Shape legend: B batch, S seq, N = B*S tokens, D hidden, I intermediate, M state size,
R dt rank, K conv kernel, V vocab, r LoRA rank.

One layer (HF MambaBlock + MambaMixer, slow path):
    h = rmsnorm(x);  [xs | z] = in_proj(h)                       [N, 2I]
    u = silu(conv1d(xs) + conv_bias)                              [B, S, I]
    [dtr | Bm | Cm] = x_proj(u);  dt = softplus(dt_proj(dtr) + dt_bias)
    y = scan(u, dt, A = -exp(A_log), Bm, Cm) + D u                (graphs/ops/scan.py)
    x_out = x + out_proj(y * silu(z))
then norm_f, the (tied) head and the masked CE of graphs/ops/loss.py. LoRA (graphs/ops/linear.py)
on in_proj, x_proj, dt_proj, out_proj. Emission order, the frozen prefix and activation
checkpointing (recompute a layer's forward from its kept input) are those of decoder.py.
The scan chunk length is `train.extra["scan_chunk"]` (default DEFAULT_CHUNK; the runtime
picks DEVICE_CHUNK[device] unless told; docs/MAMBA.md).
"""
from __future__ import annotations

from dataclasses import dataclass


from .builder import GraphBuilder
from .ops.conv import conv_backward, conv_forward
from .decoder import declare_embedding, declare_head, embed  # noqa: F401 - the same token embedding (compose.py calls it)
from .ops.linear import Proj, add_lora, frozen_weight, linear_forward, projection_backward
from .mamba_spec import MAMBA_TARGETS, MambaSpec, lora_name, weight_name
from .ops.mlp import swiglu_backward, swiglu_forward
from .ops.norm import rmsnorm_backward, rmsnorm_forward
from .ops.scan import ScanDims, scan_backward, scan_forward
from .spec import TrainSpec

EMBEDDINGS = ("backbone.embeddings.weight", "lm_head.weight")  # HF's input embedding and untied LM head
# the chunked body's FLOPs and transient memory grow with L: 4 was its fastest compiled CPU
# point (docs/MAMBA.md); what targets that inline the scan units run
DEFAULT_CHUNK = 4
# what the runtime picks per device when the user names no length. The CPU and CUDA run the
# scan on lorac's kernels (compiler/units/scan_kernels.py), where L is only how often the forward
# saves the state (hs: B x S/L x I x M) and how many steps the backward recomputes at a
# time (L x M values per channel in local memory). CPU: 64 was ~10 % faster than 32 for the
# whole 130M step at 4x256 (4.8-5.0 against 5.1-6.0 s, alternating runs; docs/BENCHMARKS.md);
# CUDA: 16 keeps the backward's chunk (L x M floats a thread) small; docs/MAMBA.md
DEVICE_CHUNK = {"cpu": 64, "cuda": 16}
_DEPTH = {"out_proj": 0, "dt_proj": 1, "x_proj": 2, "in_proj": 3}  # how far down a backward must reach


@dataclass
class MambaLayer:
    """Graph values of one layer's weights."""
    idx: int
    norm: object
    conv_w: object
    conv_b: object
    a_log: object
    d: object
    proj: dict  # target -> Proj


@dataclass
class MambaSaved:
    """What one layer's backward reads (kept by the forward, or recomputed with checkpointing)."""
    h: object  # norm output: in_proj's input
    nrm: object  # its statistics (norm.py)
    z: object  # the gate half of in_proj's output [N, I]
    xc: object  # conv output before silu [B, S, I]
    sig: object  # sigmoid(xc)
    u: object  # silu(xc) [B, S, I]: the scan's input
    u2: object  # u as [N, I]: x_proj's input
    dtr: object  # dt_proj's input [N, R]
    Bm: object  # [B, S, M]
    Cm: object
    dtp: object  # dt before softplus [N, I]
    dt: object  # [B, S, I]
    A: object  # -exp(A_log) [I, M]
    h0: object  # the scan's saved chunk states (scan.py)
    y2: object  # scan output [N, I]
    gated: object  # silu(z) * y: out_proj's input
    lora: dict  # target -> s x A^T of its LoRA (None if not adapted)


def scan_chunk(spec: MambaSpec, train: TrainSpec) -> int:
    L = train.extra.get("scan_chunk", DEFAULT_CHUNK)
    if not isinstance(L, int) or isinstance(L, bool) or L < 1:
        raise ValueError(f"scan_chunk must be a positive integer, got {L!r}")
    return min(L, train.seq)


class Ctx:
    def __init__(self, g: GraphBuilder, spec: MambaSpec, train: TrainSpec, positions=None):
        # positions: always None (TrainSpec.validate refuses packing="isolated" for Mamba)
        self.g, self.spec, self.train = g, spec, train
        self.scan = ScanDims(train.batch, train.seq, spec.intermediate, spec.state, scan_chunk(spec, train))


def declare_weights(g: GraphBuilder, spec: MambaSpec, train: TrainSpec):
    """Graph inputs for every frozen weight (HF names) and LoRA tensor (PEFT names)."""
    D, I, M, K = spec.hidden, spec.intermediate, spec.state, spec.conv_kernel
    table = declare_embedding(g, spec, train, EMBEDDINGS)
    trained = set(train.layers(spec))
    layers = []
    for i in range(spec.layers):
        w = lambda part, shape: g.input(weight_name(i, part), shape)
        L = MambaLayer(i, g.input(f"backbone.layers.{i}.norm.weight", [D]), w("conv1d.weight", [I, 1, K]),
                       w("conv1d.bias", [I]) if spec.conv_bias else None, w("A_log", [I, M]), w("D", [I]), {})
        for t in MAMBA_TARGETS:
            out, inp = spec.proj_shape(t)
            p = Proj(frozen_weight(g, train, weight_name(i, f"{t}.weight"), out, inp))
            if t == "dt_proj" or (spec.use_bias and t in ("in_proj", "out_proj")):
                p.bias = w(f"{t}.bias", [out])
            if i in trained and t in train.lora_targets:
                add_lora(g, p, lambda which: lora_name(i, t, which), train, out, inp)
            L.proj[t] = p
        layers.append(L)
    final_norm = g.input("backbone.norm_f.weight", [D])
    return table, layers, final_norm, declare_head(g, spec, train, table, EMBEDDINGS)


def silu_forward(g, x):
    # silu(x) = x sigmoid(x); keep sigmoid(x) for the backward
    sig = g.op("Sigmoid", x)
    return g.op("Mul", x, sig), sig


def silu_backward(g, dy, x, sig):
    # d silu/dx = sig + x sig (1 - sig) = sig (1 + x (1 - sig))
    one = g.f(1.0)
    return g.op("Mul", dy, g.op("Mul", sig, g.op("Add", one, g.op("Mul", x, g.op("Sub", one, sig)))))


def layer_forward(c: Ctx, x, L: MambaLayer):
    """x [N, D] -> (x_out [N, D], saved)."""
    g, sp, d = c.g, c.spec, c.scan
    B, S, I, M, R = d.batch, d.seq, sp.intermediate, sp.state, sp.dt_rank
    N = B * S
    h, nrm = rmsnorm_forward(g, x, L.norm, sp.rms_eps)
    xz, u_in = linear_forward(g, h, L.proj["in_proj"])
    z = g.slice(xz, I, 2 * I, 1)  # [N, I]
    xc = conv_forward(g, g.reshape(g.slice(xz, 0, I, 1), B, S, I), L.conv_w, L.conv_b, S, I, sp.conv_kernel)
    u, sig = silu_forward(g, xc)  # [B, S, I]
    u2 = g.reshape(u, N, I)
    dbc, u_x = linear_forward(g, u2, L.proj["x_proj"])  # [N, R + 2M]
    dtr = g.slice(dbc, 0, R, 1)
    Bm = g.reshape(g.slice(dbc, R, R + M, 1), B, S, M)
    Cm = g.reshape(g.slice(dbc, R + M, R + 2 * M, 1), B, S, M)
    dtp, u_dt = linear_forward(g, dtr, L.proj["dt_proj"])  # [N, I], dt_proj's bias included
    dt = g.reshape(g.op("Softplus", dtp), B, S, I)
    A = g.op("Neg", g.op("Exp", L.a_log))  # [I, M], < 0
    y, h0 = scan_forward(g, u, dt, A, Bm, Cm, L.d, d)
    y2 = g.reshape(y, N, I)
    gated = swiglu_forward(g, z, y2)  # silu(z) * y
    o, u_out = linear_forward(g, gated, L.proj["out_proj"])
    saved = MambaSaved(h, nrm, z, xc, sig, u, u2, dtr, Bm, Cm, dtp, dt, A, h0, y2, gated,
                       lora=dict(in_proj=u_in, x_proj=u_x, dt_proj=u_dt, out_proj=u_out))
    return g.op("Add", x, o), saved


def layer_backward(c: Ctx, dy, L: MambaLayer, s: MambaSaved, need_dx: bool, grads: dict):
    """dy = dLoss/d x_out [N, D] -> dLoss/d x_in (None if not needed); LoRA grads into `grads`.

    Without need_dx (lowest trained layer) the backward stops at the deepest adapted projection.
    """
    g, sp, d = c.g, c.spec, c.scan
    B, S, I, M = d.batch, d.seq, sp.intermediate, sp.state
    N = B * S
    depth = 4 if need_dx else max(_DEPTH[t] for t, p in L.proj.items() if p.a is not None)

    def proj_back(dout, x, t, want_dx):
        names = lora_name(L.idx, t, "A"), lora_name(L.idx, t, "B")
        return projection_backward(g, grads, names, dout, x, s.lora[t], L.proj[t], want_dx)

    # x_out = x + out_proj(silu(z) y)
    dgated = proj_back(dy, s.gated, "out_proj", depth >= 1)
    if depth < 1:
        return None
    dz, dy2 = swiglu_backward(g, dgated, s.z, s.y2)
    du, ddt, dBm, dCm = scan_backward(g, g.reshape(dy2, B, S, I), s.u, s.dt, s.A, s.Bm, s.Cm, L.d,
                                      s.h0, d)
    # dt = softplus(dtp): softplus' = sigmoid
    ddtp = g.op("Mul", g.reshape(ddt, N, I), g.op("Sigmoid", s.dtp))
    ddtr = proj_back(ddtp, s.dtr, "dt_proj", depth >= 2)
    if depth < 2:
        return None
    ddbc = g.op("Concat", ddtr, g.reshape(dBm, N, M), g.reshape(dCm, N, M), axis=1)
    du2 = proj_back(ddbc, s.u2, "x_proj", depth >= 3)
    if depth < 3:
        return None
    du = g.op("Add", du, g.reshape(du2, B, S, I))
    # kept: the conv backward reads dxc at K shifts; fused, the silu backward and the sums
    # before it were computed K times per output, and with the concat below both halves'
    # chains for every element (19 ms of a layer's CPU backward at 4x256)
    dxc = g.kept(silu_backward(g, du, s.xc, s.sig))
    dxs = g.reshape(conv_backward(g, dxc, L.conv_w, S, I, sp.conv_kernel), N, I)
    dh = proj_back(g.op("Concat", dxs, dz, axis=1), s.h, "in_proj", need_dx)
    if not need_dx:
        return None
    return g.op("Add", dy, rmsnorm_backward(g, dh, L.norm, s.nrm))


def lora_tensor_names(spec: MambaSpec, train: TrainSpec) -> list[str]:
    """Every LoRA tensor of the graph in output order: by layer, target, then A before B."""
    return [lora_name(i, t, w) for i in train.layers(spec) for t in MAMBA_TARGETS if t in train.lora_targets
            for w in ("A", "B")]


def describe(spec: MambaSpec, train: TrainSpec, kind: str) -> str:
    return f"lorac {kind} graph; model {spec}; train {train}; scan chunk {scan_chunk(spec, train)}"
