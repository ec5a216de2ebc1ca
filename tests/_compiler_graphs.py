"""Small ONNX graphs for the compiler tests, shaped like lorac's training graphs.

Weights are graph inputs under HF/PEFT names, only shape constants are initializers, and
the ops and matmul layouts are the ones lorac.graphs emits (2-D, batched 4-D, weights
transposed from [out, in], K^T, gradients as [D, N] x [N, out]). The "gradients" here are
matmuls of the right shapes, not derivatives: the compiler tests compare against
onnxruntime on the same graph, so only the op mix matters.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto as TP
from onnx import helper as h

LORA_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
LORA_B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


def tiny_training_graph(B=2, S=8, D=16, H=2, V=32, F=24, r=4) -> onnx.ModelProto:
    hd = D // H
    nodes, inits = [], []
    n = [0]

    def node(op, ins, outs=None, **attrs):
        n[0] += 1
        outs = outs or [f"t{n[0]}"]
        nodes.append(h.make_node(op, ins, outs, name=f"n{n[0]}", **attrs))
        return outs[0]

    def const(name, arr):
        inits.append(onnx.numpy_helper.from_array(np.asarray(arr), name))
        return name

    const("shp_bshd", np.array([B, S, H, hd], np.int64))
    const("shp_nd", np.array([B * S, D], np.int64))
    const("ax_last", np.array([-1], np.int64))
    const("ax0", np.array([0], np.int64))
    const("half0", np.array([0], np.int64)); const("half1", np.array([hd // 2], np.int64))
    const("halfend", np.array([hd], np.int64))
    const("two", np.array(2.0, np.float32)); const("eps", np.array(1e-6, np.float32))
    const("scale", np.array(1.0 / np.sqrt(hd), np.float32)); const("neg_big", np.array(-1e9, np.float32))
    const("s0", np.array(0, np.int64)); const("sS", np.array(S, np.int64)); const("s1", np.array(1, np.int64))
    const("ignore", np.array(-100, np.int64)); const("zero_i", np.array(0, np.int64))
    const("lora_s", np.array(2.0, np.float32)); const("theta", np.array(10000.0, np.float32))
    const("inv_idx", np.arange(hd // 2, dtype=np.float32) * 2 / hd)

    # embedding + RMSNorm
    x = node("Gather", ["model.embed_tokens.weight", "input_ids"])          # [B,S,D]
    x2 = node("Reshape", [x, "shp_nd"])                                       # [N,D]
    ms = node("ReduceMean", [node("Pow", [x2, "two"]), "ax_last"], keepdims=1)
    rinv = node("Reciprocal", [node("Sqrt", [node("Add", [ms, "eps"])])])
    xn = node("Mul", [node("Mul", [x2, rinv]), "model.layers.0.input_layernorm.weight"])
    # q with LoRA: xn W^T + s (xn A^T) B^T
    q = node("MatMul", [xn, node("Transpose", ["model.layers.0.self_attn.q_proj.weight"], perm=[1, 0])])
    xa = node("MatMul", [xn, node("Transpose", [LORA_A], perm=[1, 0])])       # [N,r]
    q = node("Add", [q, node("Mul", [node("MatMul", [xa, node("Transpose", [LORA_B], perm=[1, 0])]), "lora_s"])])
    k = node("MatMul", [xn, node("Transpose", ["model.layers.0.self_attn.k_proj.weight"], perm=[1, 0])])
    v = node("MatMul", [xn, node("Transpose", ["model.layers.0.self_attn.v_proj.weight"], perm=[1, 0])])

    # RoPE on q, k: cos/sin of positions x inverse frequencies
    pos = node("Cast", [node("Range", ["s0", "sS", "s1"])], to=TP.FLOAT)       # [S]
    inv = node("Reciprocal", [node("Pow", ["theta", "inv_idx"])])               # [hd/2]
    ang = node("Mul", [node("Unsqueeze", [pos, "ax_last"]), inv])               # [S,hd/2]
    ang = node("Concat", [ang, ang], axis=-1)                                   # [S,hd]
    cos, sin = node("Cos", [ang]), node("Sin", [ang])
    const("ax_1", np.array([1], np.int64))
    cos4 = node("Unsqueeze", [cos, "ax_1"]); sin4 = node("Unsqueeze", [sin, "ax_1"])  # [S,1,hd]

    def rope(t):
        t4 = node("Reshape", [t, "shp_bshd"])                                   # [B,S,H,hd]
        lo = node("Slice", [t4, "half0", "half1", "ax_last"])
        hi = node("Slice", [t4, "half1", "halfend", "ax_last"])
        rot = node("Concat", [node("Neg", [hi]), lo], axis=-1)
        out = node("Add", [node("Mul", [t4, cos4]), node("Mul", [rot, sin4])])
        return node("Transpose", [out], perm=[0, 2, 1, 3])                    # [B,H,S,hd]

    q4, k4 = rope(q), rope(k)
    v4 = node("Transpose", [node("Reshape", [v, "shp_bshd"])], perm=[0, 2, 1, 3])
    scores = node("Mul", [node("MatMul", [q4, node("Transpose", [k4], perm=[0, 1, 3, 2])]), "scale"])
    # causal mask from Range / LessOrEqual / Where
    ar = node("Range", ["s0", "sS", "s1"])
    keep = node("LessOrEqual", [node("Unsqueeze", [ar, "ax0"]), node("Unsqueeze", [ar, "ax_last"])])
    scores = node("Where", [keep, scores, "neg_big"])
    att = node("MatMul", [node("Softmax", [scores], axis=-1), v4])               # [B,H,S,hd]
    const("shp_n_d", np.array([B * S, D], np.int64))
    att2 = node("Reshape", [node("Transpose", [att], perm=[0, 2, 1, 3]), "shp_n_d"])
    o = node("MatMul", [att2, node("Transpose", ["model.layers.0.self_attn.o_proj.weight"], perm=[1, 0])])
    x2 = node("Add", [x2, o])
    # SwiGLU MLP
    g = node("MatMul", [x2, node("Transpose", ["model.layers.0.mlp.gate_proj.weight"], perm=[1, 0])])
    u = node("MatMul", [x2, node("Transpose", ["model.layers.0.mlp.up_proj.weight"], perm=[1, 0])])
    hmid = node("Mul", [node("Mul", [g, node("Sigmoid", [g])]), u])
    x2 = node("Add", [x2, node("MatMul", [hmid, node("Transpose", ["model.layers.0.mlp.down_proj.weight"], perm=[1, 0])])])
    # tied head + masked cross-entropy (max-shifted log-sum-exp, GatherElements)
    logits = node("MatMul", [x2, node("Transpose", ["model.embed_tokens.weight"], perm=[1, 0])])  # [N,V]
    mx = node("ReduceMax", [logits, "ax_last"], keepdims=1)
    sh = node("Sub", [logits, mx])
    lse = node("Log", [node("ReduceSum", [node("Exp", [sh]), "ax_last"], keepdims=1)])
    const("shp_n1", np.array([B * S, 1], np.int64))
    lab = node("Reshape", ["labels", "shp_n1"])
    valid = node("Not", [node("Equal", [lab, "ignore"])])
    safe = node("Where", [valid, lab, "zero_i"])
    picked = node("GatherElements", [sh, safe], axis=1)
    nll = node("Mul", [node("Sub", [lse, picked]), node("Cast", [valid], to=TP.FLOAT)])
    count = node("Max", [node("ReduceSum", [node("Cast", [valid], to=TP.FLOAT)], keepdims=0), "two"])
    node("Div", [node("ReduceSum", [nll], keepdims=0), count], ["loss"])
    # "gradients" with the layouts of the real backward: [r,N]x[N,D] and [N,D]^T x [N,r]
    dq = node("Div", [q, node("Identity", [count])])
    gA = node("MatMul", [node("Transpose", [node("MatMul", [dq, LORA_B])], perm=[1, 0]), xn])  # [r,D]
    node("Mul", [gA, "lora_s"], [LORA_A + ".grad"])
    gB = node("MatMul", [node("Transpose", [dq], perm=[1, 0]), xa])                            # [D,r]
    node("Mul", [gB, "lora_s"], [LORA_B + ".grad"])

    f = TP.FLOAT
    inputs = [h.make_tensor_value_info("input_ids", TP.INT64, [B, S]),
              h.make_tensor_value_info("labels", TP.INT64, [B, S]),
              h.make_tensor_value_info("model.embed_tokens.weight", f, [V, D]),
              h.make_tensor_value_info("model.layers.0.input_layernorm.weight", f, [D])]
    for p, (o_, i_) in {"self_attn.q_proj": (D, D), "self_attn.k_proj": (D, D), "self_attn.v_proj": (D, D),
                        "self_attn.o_proj": (D, D), "mlp.gate_proj": (F, D), "mlp.up_proj": (F, D),
                        "mlp.down_proj": (D, F)}.items():
        inputs.append(h.make_tensor_value_info(f"model.layers.0.{p}.weight", f, [o_, i_]))
    inputs += [h.make_tensor_value_info(LORA_A, f, [r, D]), h.make_tensor_value_info(LORA_B, f, [D, r])]
    outputs = [h.make_tensor_value_info("loss", f, []),
               h.make_tensor_value_info(LORA_A + ".grad", f, [r, D]),
               h.make_tensor_value_info(LORA_B + ".grad", f, [D, r])]
    graph = h.make_graph(nodes, "tiny_train", inputs, outputs, inits)
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 18)], producer_name="lorac-tests")
    model.ir_version = 9
    model = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    onnx.checker.check_model(model, full_check=True)
    return model


def random_inputs(model: onnx.ModelProto, seed: int = 0) -> dict[str, np.ndarray]:
    """Random values for every graph input: ids/labels in [0, vocab), floats ~ N(0, 0.5)."""
    rng = np.random.default_rng(seed)
    vocab = None
    for i in model.graph.input:
        if i.name.endswith("embed_tokens.weight"):
            vocab = i.type.tensor_type.shape.dim[0].dim_value
    out = {}
    for i in model.graph.input:
        shape = [d.dim_value for d in i.type.tensor_type.shape.dim]
        if i.type.tensor_type.elem_type == TP.INT64:
            out[i.name] = rng.integers(0, vocab or 16, size=shape, dtype=np.int64)
        else:
            out[i.name] = (rng.standard_normal(shape) * 0.5).astype(np.float32)
    if "labels" in out:
        out["labels"][0, 0] = -100  # exercise the ignore mask
    return out
