"""Test helpers for the Mamba-1 family: a random HF MambaForCausalLM whose scan matters."""
from __future__ import annotations

import numpy as np


def hf_mamba(cfg: dict, seed: int = 0):
    """A randomly initialised HF Mamba LM in fp32. HF's init gives dt in [1e-3, 0.1], where the
    scan barely moves the output and the x_proj/dt_proj gradients are ~1e-8; here dt is
    softplus^-1 of U(0.2, 1.5) and norms, D and biases are perturbed, so every term counts."""
    import torch
    import transformers
    torch.manual_seed(seed)
    kw = {k: v for k, v in cfg.items() if k != "model_type"}
    model = transformers.MambaForCausalLM(transformers.MambaConfig(**kw)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("dt_proj.bias"):
                dt = 0.2 + 1.3 * torch.rand_like(p)
                p.copy_(dt + torch.log(-torch.expm1(-dt)))
            elif name.endswith("A_log"):
                p.add_(0.3 * torch.randn_like(p))
            elif "norm" in name or name.endswith("bias") or name.endswith(".D"):
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith("x_proj.weight"):
                p.mul_(3.0)
    return model


def scan_reference(u, dt, A, Bm, Cm, D):
    """The recurrence itself, step by step (numpy): h_t = exp(dt A) h + dt u Bm, y = h Cm + D u."""
    b, s, i = u.shape
    h = np.zeros((b, i, A.shape[1]), dtype=np.float64)
    ys = []
    for t in range(s):
        h = np.exp(dt[:, t, :, None] * A) * h + (dt[:, t] * u[:, t])[:, :, None] * Bm[:, t, None, :]
        ys.append((h * Cm[:, t, None, :]).sum(-1) + D * u[:, t])
    return np.stack(ys, 1)
