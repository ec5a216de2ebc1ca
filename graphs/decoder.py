"""Llama / Mistral / Qwen2 / Qwen3 decoder layers, forward and backward (a family for compose.py).

Shape legend: B batch, S seq, N = B*S tokens, D hidden, H heads, K kv heads, G = H/K,
Dh head dim, I intermediate, V vocab, r LoRA rank.
"""
from __future__ import annotations

from dataclasses import dataclass

from .ops.attention import Mask, attention_backward, attention_forward, attention_saved
from .builder import GraphBuilder
from .ops.linear import (Proj, add_lora, frozen_weight, gather_rows, group_backward, linear_forward,
                         linear_group_forward, lora_inputs, projection_backward)
from .ops.mlp import swiglu_backward, swiglu_forward
from .ops.norm import rmsnorm_apply, rmsnorm_backward, rmsnorm_forward, rmsnorm_stats
from .ops.rope import rope_at, rope_backward, rope_forward, rope_tables
from .spec import ALL_TARGETS, ModelSpec, TrainSpec, lora_name, weight_name


QKV = ("q_proj", "k_proj", "v_proj")  # projections of the same input: LoRA A's in one GEMM
GATE_UP = ("gate_proj", "up_proj")


@dataclass
class Layer:
    """Graph values of one decoder layer's weights."""
    idx: int
    in_norm: object
    post_norm: object
    q_norm: object
    k_norm: object
    proj: dict  # target -> Proj


@dataclass
class Saved:
    """What one layer's backward reads (kept by the forward, or recomputed with checkpointing).

    With checkpointing (memory asked for), the backward reads only what costs a GEMM or
    attention to recompute: it recomputes the two norms' outputs (q/k/v's and gate/up's
    input, for their LoRA A gradients) from the norms' statistics, and silu(gate) * up
    (down_proj's input) from gate and up, one elementwise kernel each instead of keeping
    [N, D], [N, D] and [N, I] (0.37 GB a layer for a Llama-3-8B shape at 8192 tokens, so
    --keep-layers can keep more layers; docs/BENCHMARKS.md). Without checkpointing it
    reads them as the forward left them, which is faster (`projection_inputs`)."""
    h1: object  # input_layernorm output: q/k/v's input
    n1: object  # its statistics (norm.py): its input and rstd
    nq: object  # q_norm / k_norm statistics (qwen3), else None
    nk: object
    att: object  # attention.AttentionSaved
    a2: object  # attention output [N, H Dh]: o_proj's input
    h2: object  # post_attention_layernorm output: gate/up's input
    n2: object
    gate: object
    up: object
    act: object  # silu(gate) * up: down_proj's input
    u: dict  # target -> s x A^T of its LoRA (None if not adapted)


def projection_inputs(g, s, in_norm, post_norm, gated, lean: bool, fresh: bool = False):
    """(h1, h2, act) of a layer's Saved `s` (fields h1, n1, h2, n2, gate, up, act), the LoRA
    A gradients' inputs: as the forward kept them, or with `lean` (checkpointing) recomputed
    from the norms' statistics and gate/up (`gated`: the MLP's activation, e.g. geglu_forward;
    None where the activation's backward unit forms it: act is None, gated_mlp_backward).
    `fresh`: `s` was recomputed just before this backward (Ctx.fresh), so its norms' outputs
    are the ones its recompute formed for q/k/v's LoRA and gate/up: read as they are, not
    formed a second time (two [N, D] passes a recomputed layer)."""
    if not lean:
        return s.h1, s.h2, s.act
    act = gated(g, s.gate, s.up) if gated is not None else None
    if fresh:
        return s.h1, s.h2, act
    return rmsnorm_apply(g, in_norm, s.n1), rmsnorm_apply(g, post_norm, s.n2), act


def gated_mlp_backward(g, proj_back, dy, s, act):
    """(dgate, dup) of a SwiGLU MLP from dy = dLoss/d down_proj's output: down_proj's
    backward (`proj_back(dout, x, target)`), then SwiGLU's. `act` None (a lean layer): the
    SwiGLU backward unit also forms silu(gate) * up, down_proj's LoRA A gradient's input, in
    the kernel that reads gate and up for the gradients anyway."""
    if act is not None:
        return swiglu_backward(g, proj_back(dy, act, "down_proj"), s.gate, s.up)
    got = []

    def formed(dact):
        dgate, dup, a = swiglu_backward(g, dact, s.gate, s.up, with_act=True)
        got.extend((dgate, dup))
        return a

    proj_back(dy, formed, "down_proj")
    return tuple(got)


class Ctx:
    """What every layer shares: builder, specs, constants; with packed documents
    (`positions`, the graph input position_ids [B, S]) the RoPE rows of every token and
    the positions the attention units mask by."""

    def __init__(self, g: GraphBuilder, spec: ModelSpec, train: TrainSpec, positions=None):
        self.g, self.spec, self.train = g, spec, train
        # set by compose.py around a checkpointed layer's recompute: the backward reads neither the
        # layer's output nor down_proj's forward, so layer_forward stops before them
        self.recomputing = False
        self.fresh = False  # the layer whose backward is being emitted was recomputed for it
        B, S = train.batch, train.seq
        self.dims = (B, spec.kv_heads, spec.group, S, spec.head_dim)
        cos, sin = rope_tables(S, spec.head_dim, spec.rope_theta)
        self.positions = positions
        if positions is None:
            # [S, 1, Dh]: broadcast over the heads of token-major [B, S, heads, Dh] activations
            self.cos, self.sin = g.fconst(cos[:, None, :]), g.fconst(sin[:, None, :])
        else:  # [B, S, 1, Dh]: each token's own row (positions < S)
            self.cos, self.sin = rope_at(g, g.fconst(cos), g.fconst(sin), positions)


EMBEDDINGS = ("model.embed_tokens.weight", "lm_head.weight")  # HF's input embedding and untied LM head


def declare_embedding(g: GraphBuilder, spec, train: TrainSpec, names=EMBEDDINGS):
    """The input embedding [V, D], `names[0]`: dense, or where TrainSpec.quant names it quantized
    (graphs/ops/quant.py: the lookup dequantizes only the rows it reads)."""
    return frozen_weight(g, train, names[0], spec.vocab, spec.hidden)


def declare_head(g: GraphBuilder, spec, train: TrainSpec, embed, names=EMBEDDINGS):
    """The LM head [V, D]: a tied model's embedding itself (one input for both reads), else `names[1]`,
    dense or quantized (graphs/ops/loss.py reads a quantized head in vocabulary slices). Declared
    after the layers, where the graphs have always had it."""
    return embed if spec.tied else frozen_weight(g, train, names[1], spec.vocab, spec.hidden)


def declare_weights(g: GraphBuilder, spec: ModelSpec, train: TrainSpec):
    """Graph inputs for every frozen weight (HF names) and LoRA tensor (PEFT names)."""
    embed = declare_embedding(g, spec, train)
    trained = set(train.layers(spec))
    layers = []
    for i in range(spec.layers):
        norm = lambda name, n: g.input(f"model.layers.{i}.{name}.weight", [n])
        ln = Layer(i, norm("input_layernorm", spec.hidden), norm("post_attention_layernorm", spec.hidden),
                   norm("self_attn.q_norm", spec.head_dim) if spec.qk_norm else None,
                   norm("self_attn.k_norm", spec.head_dim) if spec.qk_norm else None, {})
        for t in ALL_TARGETS:
            out, inp = spec.proj_shape(t)
            p = Proj(frozen_weight(g, train, weight_name(i, t), out, inp))
            if (spec.qkv_bias and t in ("q_proj", "k_proj", "v_proj")) or (spec.o_bias and t == "o_proj"):
                p.bias = g.input(weight_name(i, t, "bias"), [out])
            if i in trained and t in train.lora_targets:
                add_lora(g, p, lambda which: lora_name(i, t, which), train, out, inp)
            ln.proj[t] = p
        layers.append(ln)
    final_norm = g.input("model.norm.weight", [spec.hidden])
    return embed, layers, final_norm, declare_head(g, spec, train, embed)


def _heads(g, x, n_heads, ctx: Ctx):
    """[N, n*Dh] -> [B, S, n, Dh]"""
    B, S = ctx.train.batch, ctx.train.seq
    return g.reshape(x, B, S, n_heads, ctx.spec.head_dim)


def layer_forward(c: Ctx, x, L: Layer):
    """x [N, D] -> (x_out [N, D], Saved)."""
    g, spec = c.g, c.spec
    B, K, G, S, Dh = c.dims
    N = B * S
    h1, n1 = rmsnorm_forward(g, x, L.in_norm, spec.rms_eps)
    (q, k, v), u_qkv = linear_group_forward(g, h1, [L.proj[t] for t in QKV])
    # token-major heads [B, S, heads, Dh] throughout: no layout changes around attention
    q4, k4 = _heads(g, q, K * G, c), _heads(g, k, K, c)
    nq = nk = None
    if spec.qk_norm:
        q4, nq = rmsnorm_forward(g, q4, L.q_norm, spec.rms_eps)
        k4, nk = rmsnorm_forward(g, k4, L.k_norm, spec.rms_eps)
    qr = rope_forward(g, q4, c.cos, c.sin, Dh)
    kr = rope_forward(g, k4, c.cos, c.sin, Dh)
    att, sa = attention_forward(g, qr, kr, _heads(g, v, K, c), c.dims, mask=Mask(window=spec.sliding_window),
                                positions=c.positions)
    a2 = g.reshape(att, N, K * G * Dh)
    o, uo = linear_forward(g, a2, L.proj["o_proj"])
    x1 = g.op("Add", x, o)
    h2, n2 = rmsnorm_forward(g, x1, L.post_norm, spec.rms_eps)
    (gt, up), u_gu = linear_group_forward(g, h2, [L.proj[t] for t in GATE_UP])
    u = dict(zip(QKV + GATE_UP, u_qkv + u_gu), o_proj=uo)
    if c.recomputing:  # no x_out, no silu(gate) * up: the backward forms it (recomputed_mlp_tail)
        return None, Saved(h1, n1, nq, nk, sa, a2, h2, n2, gt, up, None, recomputed_mlp_tail(u))
    act = swiglu_forward(g, gt, up)
    dn, u["down_proj"] = linear_forward(g, act, L.proj["down_proj"])
    return g.op("Add", x1, dn), Saved(h1, n1, nq, nk, sa, a2, h2, n2, gt, up, act, u)


# Host-link bytes a forward FLOP can hide: the copies out run at ~55 GB/s (an H100's profile of
# the Llama-3-8B 4x2048 step: 6.6 GB in 120 ms) while its forward computes ~3.6 TFLOP a layer in
# ~6 ms, GEMMs at 700-800 TFLOP/s with its attention, norms, dequantization and elementwise
# kernels (docs/BENCHMARKS.md): ~9.4e-5, a little margin below it
STATE_BYTES_PER_FLOP = 9e-5


def state_offload_pays(spec) -> bool:
    """Whether a recomputed layer's attention state (attention_state: x, q, k, v, the output and
    x1 in bf16, the row statistics in fp32; q and k before their norms too where the model has them)
    copies to host memory within the time its forward computes: what TrainSpec.offload_state None
    takes. Llama-3-8B and larger shapes yes, small ones no (their layers are too quick for the
    link: a Qwen3-0.6B layer would wait ~10x its compute)."""
    D, I = spec.hidden, spec.intermediate
    q, kv = spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
    flops = 2 * (2 * D * q + 2 * D * kv + 3 * D * I)
    return offload_state_bytes(spec) / flops <= STATE_BYTES_PER_FLOP


def offload_state_bytes(spec, itemsize: int = 2) -> int:
    """Bytes a token of a layer's offload slot with its attention state (attention_state; the
    input first): activations in `itemsize`, the row statistics in fp32."""
    D = spec.hidden
    q, kv = spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
    return itemsize * (2 * D + 2 * q + 2 * kv + (q + kv if spec.qk_norm else 0)) + 4 * (spec.heads + 2)


def attention_state(s: Saved) -> tuple[list, tuple]:
    """(values, wide): what a recomputed layer with offload_state sends to host memory besides
    its input (in this order; layer_refill takes them back): what its attention's backward reads
    (q, k, v, o and the row statistics lse), the q/k norms' inputs where the model has them, the
    residual sum after attention, x1 = x + o_proj(o) (the MLP's norm's input: with it the
    backward recomputes no o_proj GEMM and no residual add, ~0.5 ms a Llama-3-8B layer at 8192
    tokens, for 64 MB more on the link), and the two norms' rstd (a row sum each fewer); `wide`,
    the indices of those a bf16 step moves in fp32 (lse, the rstds: graphs/ops/offload.py)."""
    a = s.att
    values = [a.q, a.k, a.v, a.o, a.lse] + ([s.nq[0], s.nk[0]] if s.nq is not None else [])
    values += [s.n2[0], s.n1[1], s.n2[1]]  # x1, rstd of the attention's norm, rstd of the MLP's
    return values, (4, len(values) - 2, len(values) - 1)


def mlp_state(s: Saved) -> list:
    """What a recomputed layer with TrainSpec.keep_mlp keeps on the device for its backward: its MLP's
    gate and up (layer_refill takes them back instead of recomputing their GEMMs)."""
    return [s.gate, s.up]


def mlp_state_bytes(spec, itemsize: int = 2) -> int:
    """Bytes a token of mlp_state (runtime/train/memory.py)."""
    return 2 * spec.intermediate * itemsize


def layer_refill(c: Ctx, x, state: list, L: Layer, mlp: list | None = None) -> Saved:
    """A recomputed layer's Saved from its input x and its attention_state, computing only what
    they do not hold: the norms' statistics, the LoRA u of q/k/v and o_proj (s h1 A^T, s o A^T:
    thin GEMMs) and the MLP's gate and up (as layer_forward with c.recomputing), or with `mlp`
    (mlp_state, kept by the forward) only their LoRA u; no q/k/v or o_proj GEMM, no RoPE, no
    attention, no residual add. The same values as layer_forward's: the copies are exact."""
    g, spec = c.g, c.spec
    B, K, G, S, Dh = c.dims
    x1, rstd1, rstd2 = state[-3:]  # as the forward summed and normed them
    n1 = (x, rstd1)
    h1 = rmsnorm_apply(g, L.in_norm, n1)
    u_qkv = lora_inputs(g, h1, [L.proj[t] for t in QKV])
    qr, kr, v4, att, lse = state[:5]
    nq = nk = None
    if spec.qk_norm:
        nq, nk = rmsnorm_stats(g, state[5], Dh, spec.rms_eps), rmsnorm_stats(g, state[6], Dh, spec.rms_eps)
    sa = attention_saved(g, qr, kr, v4, att, lse, c.dims, mask=Mask(window=spec.sliding_window),
                         positions=c.positions)
    a2 = g.reshape(att, B * S, K * G * Dh)
    uo, = lora_inputs(g, a2, [L.proj["o_proj"]])
    n2 = (x1, rstd2)
    h2 = rmsnorm_apply(g, L.post_norm, n2)
    if mlp is None:
        (gt, up), u_gu = linear_group_forward(g, h2, [L.proj[t] for t in GATE_UP])
    else:
        (gt, up), u_gu = mlp, lora_inputs(g, h2, [L.proj[t] for t in GATE_UP])
    u = dict(zip(QKV + GATE_UP, u_qkv + u_gu), o_proj=uo)
    return Saved(h1, n1, nq, nk, sa, a2, h2, n2, gt, up, None, recomputed_mlp_tail(u))


def recomputed_mlp_tail(u: dict) -> dict:
    """A recomputed layer's `u` without down_proj's: under checkpointing the backward forms
    down_proj's input, silu(gate) * up, in SwiGLU's backward unit (gated_mlp_backward), and
    s x A^T from it (linear.linear_backward with u None), so the recompute stops after gate and
    up: no activation kernel writing [N, I] and no thin GEMM reading it (0.25 ms a layer of a
    Llama-3-8B step at 8192 tokens)."""
    return {**u, "down_proj": None}


def lora_backward(g, grads: dict, L, s):
    """(proj_back, group_back) of layer L (its `idx` and `proj`; `s.u` the saved LoRA inputs), each
    projection's LoRA gradients stored in `grads` under its names: proj_back(dout, x, target,
    want_dx=True) -> dx of one projection (projection_backward); group_back(douts, x, targets,
    want_dx=True) -> the summed dx of projections that read the same x, their LoRA terms joined
    (group_backward)."""
    def names(t):
        return lora_name(L.idx, t, "A"), lora_name(L.idx, t, "B")

    def proj_back(dout, x, t, want_dx=True):
        return projection_backward(g, grads, names(t), dout, x, s.u[t], L.proj[t], want_dx)

    def group_back(douts, x, ts, want_dx=True):
        return group_backward(g, grads, [names(t) for t in ts], douts, x, [s.u[t] for t in ts],
                              [L.proj[t] for t in ts], want_dx)

    return proj_back, group_back


def layer_backward(c: Ctx, dy, L: Layer, s: Saved, need_dx: bool, grads: dict):
    """dy = dLoss/d x_out [N, D] -> dLoss/d x_in (None if not needed); LoRA grads into `grads`."""
    g, spec = c.g, c.spec
    B, K, G, S, Dh = c.dims
    N = B * S

    proj_back, group_back = lora_backward(g, grads, L, s)

    h1, h2, act = projection_inputs(g, s, L.in_norm, L.post_norm, None, lean=c.train.checkpointing, fresh=c.fresh)
    # MLP block: x_out = x1 + down(swiglu(gate(h2), up(h2))), h2 = norm(x1)
    dgt, dup = gated_mlp_backward(g, proj_back, dy, s, act)
    dh2 = group_back([dgt, dup], h2, GATE_UP)
    dx1 = g.op("Add", dy, rmsnorm_backward(g, dh2, L.post_norm, s.n2))
    # attention block: x1 = x + o(attn(rope(q), rope(k), v)), q, k, v from h1 = norm(x)
    da2 = proj_back(dx1, s.a2, "o_proj")
    dqr, dkr, dv4 = attention_backward(g, g.reshape(da2, B, S, K * G, Dh), s.att, c.dims)
    dq4 = rope_backward(g, dqr, c.cos, c.sin, Dh)
    dk4 = rope_backward(g, dkr, c.cos, c.sin, Dh)
    if spec.qk_norm:
        dq4 = rmsnorm_backward(g, dq4, L.q_norm, s.nq)
        dk4 = rmsnorm_backward(g, dk4, L.k_norm, s.nk)
    dq = g.reshape(dq4, N, K * G * Dh)
    dk = g.reshape(dk4, N, K * Dh)
    dv = g.reshape(dv4, N, K * Dh)
    dh1 = group_back([dq, dk, dv], h1, QKV, need_dx)  # one accumulating GEMM on GPUs (compiler/passes/gemm_sum.py)
    if not need_dx:
        return None
    return g.op("Add", dx1, rmsnorm_backward(g, dh1, L.in_norm, s.n1))


def embed(g, table, ids, spec, train):
    """Token embedding: the rows of the frozen table -> [N, D] (frozen: no backward)."""
    return gather_rows(g, table, ids, train.batch * train.seq, spec.hidden)


def lora_tensor_names(spec: ModelSpec, train: TrainSpec) -> list[str]:
    """Every LoRA tensor of the graph in output order: by layer, target, then A before B."""
    return [lora_name(i, t, w) for i in train.layers(spec) for t in ALL_TARGETS if t in train.lora_targets
            for w in ("A", "B")]


def describe(spec: ModelSpec, train: TrainSpec, kind: str) -> str:
    return f"lorac {kind} graph; model {spec}; train {train}"


def activation_bytes(spec, itemsize: int, lean_extra: int = 0, full_extra: int = 0, backward_extra: int = 0):
    """Bytes a token that one trained layer of the compiled step keeps for its backward, with
    attention on cuDNN's fused unit (runtime/train/memory.py, measured on compiled CUDA plans):
    (full: no checkpointing, lean: a kept layer under checkpointing (Saved), recomputed: its
    input and the per-token statistics beside it, backward: the gradients its backward holds
    beside the full set). Lean: the input, q, k, v, the attention output, the mid-layer
    residual, gate and up (q and k again before q/k norms); full adds the norms' outputs and
    silu(gate) * up. The *_extra are a family's own values (in elements)."""
    D, I = spec.hidden, spec.intermediate
    q, kv = spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
    lean = 2 * D + 2 * q + 2 * kv + 2 * I + (q + kv if spec.qk_norm else 0) + lean_extra
    full = lean + 2 * D + I + full_extra
    return full * itemsize, lean * itemsize, 1.1 * D * itemsize, (3 * D + backward_extra) * itemsize

