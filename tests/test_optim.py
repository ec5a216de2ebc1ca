"""LoRA+ AdamW: numpy reference vs torch.optim.AdamW, schedule, groups; the ONNX optimizer
graph vs the reference on onnxruntime (and TVM's llvm build where TVM is installed)."""
import math

import numpy as np
import pytest

from lorac.runtime.optim import (LoraPlusConfig, adamw_step_reference, clip_by_global_norm, group_lrs,
                                 group_of, init_state, lr_at)

P = "base_model.model.model.layers.{i}.{mod}.lora_{ab}.weight"


def lora_tensors(rng, layers=2, r=4, d=16, ff=24):
    """A small LoRA set: q_proj (d->d), v_proj (d->d/2), down_proj (ff->d)."""
    out = {}
    for i in range(layers):
        for mod, din, dout in (("self_attn.q_proj", d, d), ("self_attn.v_proj", d, d // 2), ("mlp.down_proj", ff, d)):
            out[P.format(i=i, mod=mod, ab="A")] = rng.uniform(-1, 1, (r, din)).astype(np.float32) / math.sqrt(din)
            out[P.format(i=i, mod=mod, ab="B")] = (rng.standard_normal((dout, r)) * 0.01).astype(np.float32)
    return out


def rel_err(a, b):
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def test_group_rule_follows_peft():
    assert group_of("x.q_proj.lora_B.weight") == "B"
    assert group_of("x.q_proj.lora_A.weight") == "A"
    assert group_of("x.norm.weight", ndim=1) == "B"  # PEFT: param.ndim == 1 -> group B


def test_schedule_warmup_cosine_floor():
    cfg = LoraPlusConfig(lr=1e-3, warmup_steps=10, total_steps=110, min_lr_ratio=0.1)
    assert lr_at(1, cfg) == pytest.approx(1e-4)
    assert lr_at(10, cfg) == pytest.approx(1e-3)
    assert lr_at(60, cfg) == pytest.approx(0.55e-3)  # cosine midpoint: (lr + min_lr) / 2
    assert lr_at(110, cfg) == pytest.approx(1e-4)
    assert lr_at(500, cfg) == pytest.approx(1e-4)
    lrs = [lr_at(s, cfg) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))
    assert group_lrs(5, cfg) == (pytest.approx(5e-4), pytest.approx(5e-4 * 16))
    assert lr_at(3, LoraPlusConfig(lr=2e-4, warmup_steps=0, total_steps=1)) == pytest.approx(2e-5)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="not a finite number"):
        LoraPlusConfig(lr=float("nan"))
    with pytest.raises(ValueError, match="betas"):
        LoraPlusConfig(betas=(0.9, 1.0))


def test_reference_matches_torch_adamw_two_groups():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    params = lora_tensors(rng)
    cfg = LoraPlusConfig(lr=3e-3, loraplus_ratio=16, weight_decay=0.1, max_grad_norm=0.5,
                         warmup_steps=2, total_steps=8)
    tp = {k: torch.nn.Parameter(torch.tensor(p, dtype=torch.float64)) for k, p in params.items()}
    groups = [{"params": [tp[k] for k in tp if group_of(k) == "A"]},
              {"params": [tp[k] for k in tp if group_of(k) == "B"]}]
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
    m, v = init_state(params)
    for step in range(1, 7):
        grads = {k: (rng.standard_normal(p.shape) * (0.05 if step % 2 else 2.0)).astype(np.float32)
                 for k, p in params.items()}  # odd steps unclipped, even steps clipped
        lr_a, lr_b = group_lrs(step, cfg)
        res = adamw_step_reference(params, grads, m, v, step, lr_a, lr_b, cfg)
        assert not res.skipped
        # torch: float64 master copies, the same clip, one lr per group
        for k, t in tp.items():
            t.grad = torch.tensor(grads[k], dtype=torch.float64)
        norm = torch.nn.utils.clip_grad_norm_(list(tp.values()), cfg.max_grad_norm)
        assert float(norm) == pytest.approx(res.grad_norm, rel=1e-9)
        opt.param_groups[0]["lr"], opt.param_groups[1]["lr"] = lr_a, lr_b
        opt.step()
        params, m, v = res.params, res.m, res.v
        for k, t in tp.items():
            assert rel_err(params[k], t.detach().numpy()) <= 1e-6, (step, k)
            st = opt.state[t]
            assert rel_err(m[k], st["exp_avg"].numpy()) <= 1e-6
            assert rel_err(v[k], st["exp_avg_sq"].numpy()) <= 1e-6


def test_reference_skips_nonfinite_and_clips():
    rng = np.random.default_rng(1)
    params = lora_tensors(rng, layers=1)
    m, v = init_state(params)
    grads = {k: np.ones_like(p) for k, p in params.items()}
    clipped, norm = clip_by_global_norm(grads, 1.0)
    assert norm == pytest.approx(math.sqrt(sum(p.size for p in params.values())))
    assert math.sqrt(sum(float(np.sum(g.astype(np.float64) ** 2)) for g in clipped.values())) == pytest.approx(1.0, rel=1e-5)
    k0 = next(iter(grads))
    grads[k0] = grads[k0].copy()
    grads[k0][0, 0] = np.nan
    res = adamw_step_reference(params, grads, m, v, 1, 1e-3, 1e-2, LoraPlusConfig())
    assert res.skipped and not math.isfinite(res.grad_norm)
    for k in params:
        assert np.array_equal(res.params[k], params[k]) and not res.m[k].any() and not res.v[k].any()
