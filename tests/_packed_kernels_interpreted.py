"""Run by tests/test_packed_kernels.py with TRITON_INTERPRET=1 (Triton's interpreter must be on
before Triton is first imported): lorac's packed attention kernels in fp32 on the CPU against
fp64 causal attention of each document alone. argv[1]: the cases as JSON, name: (heads, kv
heads, head size, BM, BN, the document lengths of each row). Prints one JSON line: each
case's largest error of o, lse, dq, dk, dv, relative to max(1, the reference's largest value)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "compiler" / "targets" / "cuda"))
import packed_kernels as K  # noqa: E402 - the module alone: no TVM, no lorac import


def _positions(lengths_per_row: list[list[int]]) -> np.ndarray:
    return np.stack([np.concatenate([np.arange(n) for n in row]) for row in lengths_per_row]).astype(np.int64)


def _reference(q, k, v, do, pos, scale):
    """fp64 causal attention of each document alone: o, lse [B, S, H], dq, dk, dv."""
    B, S, H, _ = q.shape
    G = H // k.shape[2]
    q, k, v = (t.double().detach().requires_grad_() for t in (q, k, v))
    i = torch.arange(S)
    first = i[None] - torch.from_numpy(pos)
    keep = (i[None, None, :] <= i[None, :, None]) & (i[None, None, :] >= first[:, :, None])
    s = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(G, 2)) * scale
    s = s.masked_fill(~keep[:, None], float("-inf"))
    o = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), v.repeat_interleave(G, 2))
    o.backward(do.double())
    return {"o": o.detach(), "lse": torch.logsumexp(s, -1).transpose(1, 2).detach(), "dq": q.grad, "dk": k.grad,
            "dv": v.grad}


def _run(q, k, v, do, pos, scale, BM, BN):
    B, S, H, D = q.shape
    KH = k.shape[2]
    p = torch.from_numpy(pos)
    out = {"o": torch.full_like(q, float("nan")), "lse": torch.full((B, S, H), float("nan")),
           "dq": torch.full_like(q, float("nan")), "dk": torch.full_like(k, float("nan")),
           "dv": torch.full_like(v, float("nan"))}
    delta = torch.full((B, S, H), float("nan"))
    K.fwd[(triton.cdiv(S, BM), B * H)](q, k, v, p, out["o"], out["lse"], scale, S, H=H, KH=KH, D=D, BM=BM, BN=BN)
    K.delta[(triton.cdiv(S, BM), B * H)](out["o"], do, delta, S, H=H, D=D, BM=BM)
    K.bwd_kv[(triton.cdiv(S, BN), B * KH)](q, k, v, do, out["lse"], delta, p, out["dk"], out["dv"], scale, S,
                                          H=H, KH=KH, D=D, BM=BM, BN=BN)
    K.bwd_q[(triton.cdiv(S, BM), B * H)](q, k, v, do, out["lse"], delta, p, out["dq"], scale, S,
                                        H=H, KH=KH, D=D, BM=BM, BN=BN)
    return out


def main() -> None:
    out = {}
    for name, (heads, kv_heads, D, BM, BN, rows) in json.loads(sys.argv[1]).items():
        pos = _positions(rows)
        B, S = pos.shape
        g = torch.Generator().manual_seed(S * heads + D)
        q, do = (torch.randn((B, S, heads, D), generator=g) for _ in range(2))
        k, v = (torch.randn((B, S, kv_heads, D), generator=g) for _ in range(2))
        got = _run(q, k, v, do, pos, D ** -0.5, BM, BN)
        want = _reference(q, k, v, do, pos, D ** -0.5)
        out[name] = {n: float((got[n].double() - w).abs().max()) / max(1.0, float(w.abs().max()))
                     for n, w in want.items()}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
