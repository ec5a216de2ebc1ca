"""The fused attention units on the GPU against a float64 reference, at several shapes.

    .venv/bin/python bench/h200_attention_check.py prepare ROOT     # here: compile (no GPU)
    python3 bench/h200_attention_check.py device ROOT               # GPU machine, runtime-only TVM

Each case is a graph of the two units alone (forward, then the backward of a random
cotangent): outputs o, dq, dk, dv. It is compiled for CUDA twice: bf16 (the units mapped to
cuDNN's fused SDPA) and fp32 (the units' ONNX bodies inlined as TVM kernels: the decomposed
path). On the GPU both run on the same random inputs and are compared with numpy in float64:
max |err| / max |ref| and the cosine, per output. Shapes: GQA ratios 1, 3 and 8, head dims
64 and 128, sequence lengths that are not powers of two.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

CASES = [(2, 1000, 12, 4, 64), (1, 513, 8, 8, 128), (2, 256, 16, 2, 128)]  # B, S, H, K, Dh


def _graph(B, S, H, K, Dh):
    from lorac.graphs.ops.attention import attention_backward, attention_forward
    from lorac.graphs.builder import GraphBuilder

    g = GraphBuilder("attention_check")
    q, k, v = g.input("q", [B, S, H, Dh]), g.input("k", [B, S, K, Dh]), g.input("v", [B, S, K, Dh])
    do = g.input("do", [B, S, H, Dh])
    dims = (B, K, H // K, S, Dh)
    o, saved = attention_forward(g, q, k, v, dims)
    dq, dk, dv = attention_backward(g, do, saved, dims)
    for x, name in ((o, "o"), (dq, "dq"), (dk, "dk"), (dv, "dv")):
        g.output(x, name)
    return g.finish()


def prepare(root: Path) -> None:
    from lorac.compiler import compile_graph
    for case in CASES:
        graph = _graph(*case)
        for dtype in ("bfloat16", "float32"):
            out = root / f"{'x'.join(map(str, case))}-{dtype}"
            compile_graph(graph, target="cuda", out_dir=out, dtype=dtype)
            print(out.name, json.loads((out / "manifest.json").read_text())["units"], flush=True)


def reference(q, k, v, do, scale):
    """float64 causal GQA attention and its gradients (k, v heads repeated as HF does)."""
    G = q.shape[2] // k.shape[2]
    kk, vv = np.repeat(k, G, axis=2), np.repeat(v, G, axis=2)
    S = q.shape[1]
    s = np.einsum("bihd,bjhd->bhij", q, kk) * scale
    s = np.where(np.tril(np.ones((S, S), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o = np.einsum("bhij,bjhd->bihd", p, vv)
    dp = np.einsum("bihd,bjhd->bhij", do, vv)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True)) * scale
    dq = np.einsum("bhij,bjhd->bihd", ds, kk)
    dkk = np.einsum("bhij,bihd->bjhd", ds, q)
    dvv = np.einsum("bhij,bihd->bjhd", p, do)
    fold = lambda x: x.reshape(x.shape[0], S, k.shape[2], G, x.shape[-1]).sum(3)  # sum each kv head's group
    return {"o": o, "dq": dq, "dk": fold(dkk), "dv": fold(dvv)}


def device(root: Path) -> None:
    sys.modules["torch"] = None
    from lorac.runtime.engine.artifact import load_artifact
    rows = []
    for case in CASES:
        B, S, H, K, Dh = case
        rng = np.random.default_rng(sum(case))
        x = {n: rng.standard_normal(s).astype(np.float32) for n, s in
             (("q", (B, S, H, Dh)), ("k", (B, S, K, Dh)), ("v", (B, S, K, Dh)), ("do", (B, S, H, Dh)))}
        ref = reference(*(x[n].astype(np.float64) for n in ("q", "k", "v", "do")), Dh ** -0.5)
        for dtype in ("bfloat16", "float32"):
            r = {"case": f"B={B} S={S} H={H} K={K} Dh={Dh}", "path": "cuDNN" if dtype == "bfloat16" else "inlined fp32"}
            try:
                out = load_artifact(root / f"{'x'.join(map(str, case))}-{dtype}", "cuda")(x)
                for n, want in ref.items():
                    got = out[n].astype(np.float64)
                    r[n] = [float(np.abs(got - want).max() / np.abs(want).max()),
                            float((got * want).sum() / np.linalg.norm(got) / np.linalg.norm(want))]
            except Exception as e:  # report and go on
                r["error"] = f"{type(e).__name__}: {e}"[:400]
            print(json.dumps(r), flush=True)
            rows.append(r)
    bad = [r for r in rows if "error" in r or any(v[1] < 0.999 for k, v in r.items() if isinstance(v, list))]
    print("attention check:", "FAIL" if bad else "ok", f"({len(rows)} runs)")


if __name__ == "__main__":
    (prepare if sys.argv[1] == "prepare" else device)(Path(sys.argv[2]))
