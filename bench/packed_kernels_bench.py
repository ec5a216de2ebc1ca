"""The `kernel` variant of bench/cudnn_isolated_speed.py: lorac's Triton kernels for attention
over packed documents (compiler/targets/cuda/packed_kernels.py), JIT-compiled by the GPU
machine's Triton on torch's tensors, checked against the fp32 reference per document, then
each kernel timed over the block configurations below; the variant's time is the sum of each
kernel's fastest. Prints every configuration's time, so the compiler's choice can be read off.
"""
from __future__ import annotations

import importlib.util

import cudnn_isolated_common as C
from cudnn_isolated_common import Outputs, timed

# (BM, BN, num_warps, num_stages)
CONFIGS = {
    "fwd": [(128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (128, 64, 4, 3), (64, 128, 4, 2), (128, 32, 4, 3)],
    "delta": [(128, 0, 4, 1), (64, 0, 4, 1)],
    "bwd_kv": [(64, 128, 8, 2), (32, 128, 8, 2), (64, 64, 4, 2), (32, 64, 4, 3), (64, 128, 4, 2), (128, 128, 8, 2)],
    "bwd_q": [(128, 64, 8, 2), (64, 64, 4, 3), (128, 32, 8, 2), (64, 128, 8, 2), (128, 64, 4, 2)],
}
DEFAULT = {"fwd": (128, 64, 8, 3), "delta": (128, 0, 4, 1), "bwd_kv": (64, 128, 8, 2), "bwd_q": (128, 64, 8, 2)}


def kernels():
    spec = importlib.util.spec_from_file_location("packed_kernels", C.REPO / "compiler/targets/cuda/packed_kernels.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class Launch:
    """The four kernels on one batch's tensors, each at a chosen configuration."""

    def __init__(self, K, pos, x, out_bufs):
        import torch
        a = C.ARGS
        self.K, self.B, self.S, self.H, self.KH, self.D = K, a.batch, a.seq, a.heads, a.kv_heads, a.head_dim
        self.scale = a.head_dim ** -0.5
        self.pos = torch.from_numpy(pos).to(C.DEV)
        self.x = x
        self.o, self.lse, self.dq, self.dk, self.dv = out_bufs
        self.delta = torch.empty((self.B, self.S, self.H), dtype=torch.float32, device=C.DEV)

    def run(self, name: str, cfg) -> None:
        import triton
        BM, BN, w, st = cfg
        B, S, H, KH, D, x = self.B, self.S, self.H, self.KH, self.D, self.x
        if name == "fwd":
            self.K.fwd[(triton.cdiv(S, BM), B * H)](x["q"], x["k"], x["v"], self.pos, self.o, self.lse, self.scale, S,
                                                   H=H, KH=KH, D=D, BM=BM, BN=BN, num_warps=w, num_stages=st)
        elif name == "delta":
            self.K.delta[(triton.cdiv(S, BM), B * H)](self.o, x["do"], self.delta, S, H=H, D=D, BM=BM, num_warps=w)
        elif name == "bwd_kv":
            self.K.bwd_kv[(triton.cdiv(S, BN), B * KH)](x["q"], x["k"], x["v"], x["do"], self.lse, self.delta, self.pos,
                                                       self.dk, self.dv, self.scale, S, H=H, KH=KH, D=D, BM=BM, BN=BN,
                                                       num_warps=w, num_stages=st)
        else:
            self.K.bwd_q[(triton.cdiv(S, BM), B * H)](x["q"], x["k"], x["v"], x["do"], self.lse, self.delta, self.pos,
                                                     self.dq, self.scale, S, H=H, KH=KH, D=D, BM=BM, BN=BN,
                                                     num_warps=w, num_stages=st)

    def all(self, chosen: dict) -> None:
        for name in ("fwd", "delta", "bwd_kv", "bwd_q"):
            self.run(name, chosen[name])


def variant(ctx, pos, x, ref) -> dict:
    """Check at DEFAULT, then time every configuration of each kernel; the fastest's sum."""
    a = C.ARGS
    K = kernels()
    out = Outputs()
    o, lse, dq, dk, dv = out.buffers()
    L = Launch(K, pos, x, (o, lse.view(a.batch, a.seq, a.heads), dq, dk, dv))
    L.all(DEFAULT)
    C.sync()
    res = out.checked(ref, a.batch * a.seq)
    r = {"ok": res["ok"], **{k: round(res[k]["cosine"], 7) for k in ("o", "dq", "dk", "dv")},
         "lse_rel_err": res["lse"]["rel_err"], "guard_untouched": all(res["guard_untouched"].values())}
    best, table = {}, {}
    for name, cfgs in CONFIGS.items():
        for cfg in cfgs:
            try:
                ms = timed(lambda: L.run(name, cfg), a.iters)
            except Exception as e:  # noqa: BLE001 - a configuration may not fit the GPU's shared memory
                table[f"{name}{cfg}"] = f"{type(e).__name__}: {str(e)[:120]}"
                continue
            table[f"{name}{cfg}"] = round(ms, 4)
            if name not in best or ms < best[name][1]:
                best[name] = (cfg, ms)
    for key, ms in table.items():
        print(f"    {key:28s} {ms}")
    L.all({n: c for n, (c, _) in best.items()})  # the fastest configurations, checked too
    C.sync()
    res2 = out.checked(ref, a.batch * a.seq)
    r["ok"] = r["ok"] and res2["ok"]
    r["configs"] = table
    r["best"] = {n: list(c) for n, (c, _) in best.items()}
    r["forward_ms"] = best["fwd"][1]
    r["backward_ms"] = best["delta"][1] + best["bwd_kv"][1] + best["bwd_q"][1]
    r["fwd_plus_bwd_ms"] = r["forward_ms"] + r["backward_ms"]
    return r
