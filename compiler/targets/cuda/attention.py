"""The attention units on CUDA, mapped whole to cuDNN's fused SDPA (flash attention).

    CausalAttention(q, k, v, scale)                 -> o, lse     lorac.attention_fwd(q, k, v, o, lse)
    CausalAttentionGrad(q, k, v, o, do, lse, scale) -> dq, dk, dv  lorac.attention_bwd(q, k, v, o, do, lse, dq, dk, dv)
    PackedCausalAttention(q, k, v, pos, scale)      -> o, lse     lorac.attention_packed_fwd(q, k, v, pos, o, lse)
    PackedCausalAttentionGrad(q, k, v, o, do, lse, pos, scale)
                                                    -> dq, dk, dv  lorac.attention_packed_bwd(q, k, v, o, do, lse, pos,
                                                                                             dq, dk, dv)

q, do [B, S, H, Dh] and k, v [B, S, K, Dh] in the graph's token-major layout, which cuDNN
reads through strides (no transposes); GQA is native (k, v keep their K heads); lse is
cuDNN's "stats" in fp32: [B, H, S, 1], and for packed rows (--packing isolated: pos [B, S]
the position ids) token-major [B, S, H, 1], as cuDNN's ragged layout writes it (only the
backward unit reads it). How the packed calls mask documents (`PACKED_MASK`, the manifest
call's "mask"):
- "kernel" (the default where Triton is installed, for rows of up to KERNEL_MAX_SEQ tokens): lorac's own kernels
  (compiler/targets/cuda/packed_kernels.py), compiled here ahead of time into cubins beside
  the library (packed_build.py) and launched by the runtime through the CUDA driver; `pos`
  is read on the device (each query's document starts pos[b, i] keys back), tiles outside
  every document are skipped, lse token-major [B, S, H, 1]. The call records pos's dtype.
- "ragged": each document a sequence of cuDNN's ragged layout; their lengths and offsets
  come from position_ids at run time (the runtime fills them before each call of the
  artifact), so `pos` is passed along, not read;
- "bias": plain rows plus an additive bias [B, 1, S, S] bf16, 0 where key j >= i - pos[b, i]
  and -1e30 before (causal masking hides the keys after i), computed here once per step
  from the position ids by one elementwise kernel and passed in `pos`'s place; lse [B, H, S, 1].
Without Triton the build falls back to cuDNN: the bias for rows of at most BIAS_MAX_SEQ
tokens while the bias takes at most BIAS_MAX_BYTES, ragged past either.
The softmax scale (a constant), the shapes and the mask go to the manifest's `unit_calls`,
one entry per distinct call. The runtime (lorac.runtime.devices.cuda.attention) registers the functions: cuDNN
plans built once per shape, executed on TVM's stream, so CUDA graphs capture them like the
GEMMs. Soft-capped and windowed variants stay inlined (compiler/units/__init__.py).

cuDNN's SDPA takes bf16/fp16 operands: q, k, v, o, do are narrowed to bf16 here (a cast
that fuses into the kernel producing them, RoPE for q and k) and the fp32 results are
widened back; softmax statistics and accumulation stay fp32 inside cuDNN. The narrowed
copies are shared between a forward and its backward, so the backward reads the bf16
tensors the forward kept instead of keeping fp32 ones alive and casting twice.
"""
from __future__ import annotations

import sys

import tvm
from tvm import relax

from lorac.core.constants import (PACKED_BIAS_MAX_BYTES, PACKED_BIAS_MAX_SEQ, PACKED_KERNEL_MAX_SEQ,
                                  packed_bias_bytes)

from . import packed_build

FWD, BWD = "lorac.attention_fwd", "lorac.attention_bwd"
PACKED_FWD, PACKED_BWD = "lorac.attention_packed_fwd", "lorac.attention_packed_bwd"
_BF16 = "bfloat16"
# How packed documents are masked, chosen from bench/cudnn_isolated_check.py (the call alone) and
# bench/h200_packed_step.py (whole steps; docs/BENCHMARKS.md, "Isolated packing"): lorac's kernels
# for rows of up to 4096 tokens (Qwen3-0.6B shape 8x1024, rows of 4-40 documents, H100: 0.64x the
# plain cuDNN call, where cuDNN's bias costs 1.33-1.47x and its ragged layout 1.5-1.8x); past
# that, and without Triton, cuDNN: the bias for rows of up to 1024 tokens, ragged for longer rows
# (on an H100 ragged 0.65-0.94x the plain call at 2048-8192 tokens, the bias 1.6-2.2x)
PACKED_MASK = "kernel"
BIAS_MAX_BYTES = PACKED_BIAS_MAX_BYTES  # "bias" while the [B, 1, S, S] bf16 bias fits this ...
BIAS_MAX_SEQ = PACKED_BIAS_MAX_SEQ  # ... and rows are at most this long; ragged past either
KERNEL_MAX_SEQ = PACKED_KERNEL_MAX_SEQ  # lorac's kernels for rows of at most this many tokens, cuDNN past it
_told = []  # the fallback note, printed once a process


def packed_mask(B: int, S: int, H: int, K: int, Dh: int) -> str:
    """How the packed calls of [B, S] rows of H query and K key heads of Dh mask documents:
    "kernel", "ragged" or "bias" (module doc)."""
    if PACKED_MASK == "kernel" and S <= KERNEL_MAX_SEQ and packed_build.supports(H, K, Dh):
        why = packed_build.unavailable()
        if why is None:
            return "kernel"
        if not _told:
            _told.append(why)
            print(f"note: packed documents masked on cuDNN (slower, docs/BENCHMARKS.md): {why}", file=sys.stderr)
    return "bias" if PACKED_MASK != "ragged" and packed_bias_bytes(B, S, BIAS_MAX_BYTES, BIAS_MAX_SEQ) else "ragged"


def document_bias(bb, pos, B: int, S: int):
    """The bias [B, 1, S, S] bf16 of packed rows from their position ids pos [B, S]: 0 where
    key j >= i - pos[b, i], MASKED (graphs/ops/attention.py) before; int32 index math."""
    from lorac.graphs.ops.attention import MASKED
    idx = relax.op.arange(0, S, 1, "int32")
    start = bb.emit(relax.op.subtract(relax.op.reshape(idx, [1, 1, S, 1]),
                                      relax.op.reshape(relax.op.astype(pos, "int32"), [B, 1, S, 1])))
    seen = bb.emit(relax.op.greater_equal(relax.op.reshape(idx, [1, 1, 1, S]), start))
    wide = bb.emit(relax.op.where(seen, relax.const(0.0, "float32"), relax.const(MASKED, "float32")))
    return bb.emit(relax.op.astype(wide, _BF16))


class Narrowing:
    """bf16 versions of fp32 values, emitted once per value in one frontend run."""

    def __init__(self):
        self.narrow = {}  # fp32 var -> its bf16 cast
        self.source = {}  # fp32 var (a widened unit output) -> the bf16 original

    def __call__(self, bb, x):
        if x.ty.dtype == _BF16:
            return x
        hit = self.source.get(x)
        if hit is None:
            hit = self.narrow.get(x)
        if hit is None:
            hit = self.narrow[x] = bb.emit(relax.op.astype(x, _BF16))
        return hit

    def widen(self, bb, x):
        wide = bb.emit(relax.op.astype(x, "float32"))
        self.source[wide] = x
        return wide


def _shape(x) -> list[int]:
    return [int(d) for d in x.ty.shape.values]


def _scale(x) -> float:
    """The value of the softmax scale input (a folded scalar constant)."""
    if not isinstance(x, tvm.ir.expr.Constant):
        raise ValueError("attention unit: the softmax scale must be a constant")
    return float(x.value.numpy())


def converters(cache: Narrowing | None = None) -> dict:
    """Converter classes for the frontend (compiler.units.frontend_with), with one
    narrowing cache for the whole graph (`cache`: shared with the offload units). Each class's `calls` lists the shapes it
    converted (manifest `unit_calls`: the runtime builds their cuDNN plans at load time,
    before a CUDA graph captures the step)."""
    from ...units import unit_converter

    cache = Narrowing() if cache is None else cache
    calls: list = []
    biases: dict = {}  # position ids var -> its documents' bias (one per step, shared by every layer)

    def masking(bb, pos, q, k):
        """(how this packed call masks documents, what it takes in pos's place)."""
        B, S, H, Dh = _shape(q)
        mask = packed_mask(B, S, H, _shape(k)[2], Dh)
        if mask in ("ragged", "kernel"):
            return mask, pos
        if pos not in biases:
            biases[pos] = document_bias(bb, pos, B, S)
        return mask, biases[pos]

    def record(fn, q, k, scale, mask=None, pos=None):
        """Note the call; the scale travels in the manifest, not as an argument (a float
        argument costs a host-side function per call in TVM's VM)."""
        B, S, H, Dh = _shape(q)
        call = {"function": fn, "B": B, "S": S, "H": H, "K": _shape(k)[2], "Dh": Dh, "scale": scale,
                **({"mask": mask} if mask else {}), **({"pos_dtype": str(pos.ty.dtype)} if mask == "kernel" else {})}
        same_shape = [c for c in calls if {**c, "scale": scale} == call]
        if same_shape and same_shape[0]["scale"] != scale:
            raise ValueError(f"attention calls of one shape with two softmax scales: {call}")
        if not same_shape:
            calls.append(call)

    def forward(fn, packed):
        """A forward converter: inputs q, k, v (, pos), scale."""
        def convert(bb, inputs, _attrs, _params):
            q, k, v = (cache(bb, x) for x in inputs[:3])
            B, S, H, Dh = _shape(q)
            mask, xm = masking(bb, inputs[3], q, k) if packed else (None, None)
            record(fn, q, k, _scale(inputs[-1]), mask, xm)
            lse = [B, S, H, 1] if mask in ("ragged", "kernel") else [B, H, S, 1]
            out = bb.emit(relax.call_dps_packed(
                fn, [q, k, v] + ([xm] if packed else []),
                [relax.TensorType([B, S, H, Dh], _BF16), relax.TensorType(lse, "float32")]))
            o = bb.emit(relax.TupleGetItem(out, 0))
            return relax.Tuple([cache.widen(bb, o), bb.emit(relax.TupleGetItem(out, 1))])
        return convert

    def backward(fn, packed):
        """A backward converter: inputs q, k, v, o, do, lse (, pos), scale."""
        def convert(bb, inputs, _attrs, _params):
            q, k, v, o, do = (cache(bb, x) for x in inputs[:5])
            mask, xm = masking(bb, inputs[6], q, k) if packed else (None, None)
            record(fn, q, k, _scale(inputs[-1]), mask, xm)
            out = bb.emit(relax.call_dps_packed(
                fn, [q, k, v, o, do, inputs[5]] + ([xm] if packed else []),
                [relax.TensorType(_shape(x), _BF16) for x in (q, k, v)]))
            return relax.Tuple([bb.emit(relax.op.astype(bb.emit(relax.TupleGetItem(out, i)), "float32"))
                                for i in range(3)])
        return convert

    return {"CausalAttention": unit_converter("CausalAttention", forward(FWD, False), unit_calls=calls),
            "CausalAttentionGrad": unit_converter("CausalAttentionGrad", backward(BWD, False), unit_calls=calls),
            "PackedCausalAttention": unit_converter("PackedCausalAttention", forward(PACKED_FWD, True),
                                                    unit_calls=calls),
            "PackedCausalAttentionGrad": unit_converter("PackedCausalAttentionGrad", backward(PACKED_BWD, True),
                                                        unit_calls=calls)}
