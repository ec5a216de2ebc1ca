"""Gated MLP activations, forward and backward: SwiGLU a = silu(gate) * up (Llama, Qwen, Phi-3,
Mamba's gate) and GeGLU a = gelu_tanh(gate) * up (Gemma 2). Shapes: gate, up [N, I] (or any
shape: every op is elementwise, so SwiGLU's backward units bake in only the dtype)."""
from __future__ import annotations


def swiglu_forward(g, gate, up):
    # silu(x) = x sigmoid(x). Nothing beyond gate and up is kept: the backward recomputes
    # sigmoid(gate) inside its own kernel, cheaper than storing an [N, I] fp32 tensor and
    # reading it back (a separate sigmoid kernel and 96 MB a layer for Qwen3-0.6B at 8x1024)
    return g.op("Mul", g.op("Mul", gate, g.op("Sigmoid", gate)), up)


SWIGLU_GRAD = "SwiGLUGrad"  # (da, gate, up) -> (dgate, dup)
SWIGLU_GRAD_ACT = "SwiGLUGradAct"  # (da, gate, up) -> (dgate, dup, silu(gate) * up)


def swiglu_backward(g, da, gate, up, with_act: bool = False):
    """(dgate, dup), with `with_act` also a = silu(gate) * up (down_proj's input, which a lean
    layer recomputes instead of keeping: graphs/decoder.py). A unit: on CUDA bf16 one kernel
    reads da, gate and up once and writes all its results (compiler/units/swiglu.py), where
    inlined each result is a kernel of its own that reads them again."""
    name = SWIGLU_GRAD_ACT if with_act else SWIGLU_GRAD
    return g.call(name, g.np_float.name, [da, gate, up], 3 if with_act else 2,
                  lambda fb, d, gt, u: _swiglu_grad_body(fb, d, gt, u, with_act))


def _swiglu_grad_body(g, da, gate, up, with_act: bool):
    # d silu/dx = sg (1 + x (1 - sg)); dgate = da up silu'(gate), dup = da silu(gate).
    # Each result computes sigmoid(gate) itself: one shared sigmoid would be a kernel of its
    # own, writing [N, I] fp32 that both results' kernels then read (units.KEPT_APART keeps
    # the inlined copies from merging)
    one = g.f(1.0)
    sg = g.op("Sigmoid", gate)
    dsilu = g.op("Mul", sg, g.op("Add", one, g.op("Mul", gate, g.op("Sub", one, sg))))
    dgate = g.op("Mul", g.op("Mul", da, up), dsilu)
    dup = g.op("Mul", da, g.op("Mul", gate, g.op("Sigmoid", gate)))
    return (dgate, dup, swiglu_forward(g, gate, up)) if with_act else (dgate, dup)


GELU_C = 0.7978845608028654  # sqrt(2 / pi)
GELU_A = 0.044715


def geglu_forward(g, gate, up):
    # a = gelu_tanh(gate) * up, gelu_tanh(x) = x/2 (1 + tanh(c (x + a x^3))) (HF "gelu_pytorch_tanh").
    # As for SwiGLU, only gate and up are kept: the backward recomputes the tanh
    return g.op("Mul", _gelu_tanh(g, gate)[0], up)


def _gelu_tanh(g, x):
    """(gelu_tanh(x), t = tanh(c (x + a x^3)))."""
    x2 = g.op("Mul", x, x)
    t = g.op("Tanh", g.op("Mul", g.op("Mul", x, g.op("Add", g.f(1.0), g.op("Mul", x2, g.f(GELU_A)))), g.f(GELU_C)))
    return g.op("Mul", g.op("Mul", x, g.f(0.5)), g.op("Add", g.f(1.0), t)), t


def geglu_backward(g, da, gate, up):
    # gelu_tanh'(x) = (1 + t)/2 + x/2 (1 - t^2) c (1 + 3a x^2); dgate = da up gelu', dup = da gelu(gate)
    gelu, t = _gelu_tanh(g, gate)
    one = g.f(1.0)
    inner = g.op("Mul", g.op("Add", one, g.op("Mul", g.op("Mul", gate, gate), g.f(3 * GELU_A))), g.f(GELU_C))
    dgelu = g.op("Add", g.op("Mul", g.op("Add", one, t), g.f(0.5)),
                 g.op("Mul", g.op("Mul", g.op("Mul", gate, g.f(0.5)), g.op("Sub", one, g.op("Mul", t, t))), inner))
    return g.op("Mul", g.op("Mul", da, up), dgelu), g.op("Mul", da, gelu)
