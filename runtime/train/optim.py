"""LoRA+ AdamW in numpy: the reference (test oracle) for the compiled optimizer graph.

Shapes: every tensor is a float32 LoRA matrix, A [r, in] or B [out, r], keyed by its PEFT
name. The runtime normally runs `lorac.graphs.optimizer` compiled on the device; this file
is what that graph must agree with (<= 1e-6 relative), plus the pieces the training loop
calls on the host: the schedule (`lr_at`, `group_lrs`) and the parameter-group rule.

One step (step t is 1-based, the count of updates applied so far including this one):
    norm  = sqrt(sum over all tensors of sum(g^2))        global gradient norm
    if norm is NaN/Inf: nothing changes, the caller must not advance t (`skipped`)
    c     = min(1, max_grad_norm / (norm + 1e-6))         torch's clip_grad_norm_ factor
    g     = c * g
    m     = b1 m + (1 - b1) g                             first moment
    v     = b2 v + (1 - b2) g^2                           second moment
    mhat  = m / (1 - b1^t), vhat = v / (1 - b2^t)         bias correction
    p     = p - lr * (mhat / (sqrt(vhat) + eps) + wd p)   decoupled decay (AdamW, llm.c)
with lr = lr_a for group A and lr_b = ratio * lr_a for group B (LoRA+).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from lorac.core.loraplus import decays, group_of  # noqa: F401 (the rule's home is core; callers import it here too)

from lorac.core.settings import setting

from ..errors import LoracError

# The settings the runtime passes to the compiled optimizer as inputs on every step (the
# schedule): changing them never recompiles. Every other field of LoraPlusConfig is baked
# into the graph (lorac.core.loraplus.AdamWConstants, part of its cache key).
SCHEDULE_FIELDS = ("lr", "loraplus_ratio", "warmup_steps", "total_steps", "min_lr_ratio")


@dataclass
class LoraPlusConfig:
    """The optimizer's settings, defaults and reasons: the one source of these defaults
    (TrainConfig's --lr, --loraplus-ratio, --warmup, --weight-decay and --max-grad-norm take
    theirs from here, core/settings.like)."""
    # 2e-4: LoRA's most common rate (QLoRA's for 7B-13B models), for the A matrices; B moves
    # loraplus_ratio times faster. The LoRA+ authors (and PEFT's docstring) advise a lower
    # rate when the ratio is large: halve it for long runs whose loss spikes.
    lr: float = setting(2e-4, "learning rate of the LoRA A matrices, in (0, 1]; B gets lr * loraplus_ratio (a negative "
                        "value on the command line: --lr=-1e-3 or --lr -1e-3, refused by the range)")
    # ratio lr_B / lr_A; 16 is the LoRA+ paper's and PEFT's recommended default.
    loraplus_ratio: float = setting(16.0, "LoRA+ ratio: lr(B) = ratio * lr(A), in (0, 1000]")
    # (0.9, 0.999) and 1e-8 are torch.optim.AdamW's and HF TrainingArguments' defaults.
    betas: tuple[float, float] = setting((0.9, 0.999), "AdamW betas (b1, b2)")
    eps: float = setting(1e-8, "AdamW epsilon")
    # 0.0 as PEFT's create_loraplus_optimizer (loraplus_weight_decay) and HF Trainer: LoRA
    # matrices are small and regularised by their rank already; torch's 0.01 is for dense nets.
    weight_decay: float = setting(0.0, "AdamW decoupled weight decay (not on 1-D tensors), in [0, 1]")
    # 1.0 is HF Trainer's default; <= 0 disables clipping (the norm is still computed).
    max_grad_norm: float = setting(1.0, "global gradient-norm clip (<= 0: off)")
    # 4 steps of linear warmup from lr/4: Adam's first updates are sign-like (about lr per
    # element whatever the gradient), so the first steps move B off zero more gently.
    warmup_steps: int = setting(4, "linear warmup steps, then a cosine decay to lr * min_lr_ratio (0.1 by default)")
    # cosine decay from lr at warmup_steps to min_lr_ratio*lr at total_steps (then flat);
    # the training loop sets it to --steps
    total_steps: int = setting(1000, "end of the cosine decay")
    # nanoGPT decays to lr/10 ("min_lr should be ~= learning_rate/10 per Chinchilla")
    min_lr_ratio: float = setting(0.1, "the cosine's floor, as a fraction of lr")

    def __post_init__(self):
        for key in ("lr", "loraplus_ratio", "eps", "weight_decay", "max_grad_norm", "min_lr_ratio"):
            if not math.isfinite(float(getattr(self, key))):
                raise LoracError(f"optimizer setting {key}={getattr(self, key)!r} is not a finite number")
        b1, b2 = self.betas
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise LoracError(f"optimizer betas={self.betas!r} must both lie in [0, 1)")
        if self.lr < 0 or self.eps <= 0 or self.weight_decay < 0 or self.loraplus_ratio <= 0:
            raise LoracError("optimizer lr, weight_decay must be >= 0 and eps, loraplus_ratio > 0")
        if self.warmup_steps < 0 or self.total_steps < 1:
            raise LoracError(f"warmup_steps={self.warmup_steps} must be >= 0 and total_steps={self.total_steps} >= 1")


# -- schedule ----------------------------------------------------------------------------
def lr_at(step: int, cfg: LoraPlusConfig) -> float:
    """Learning rate of group A for the 1-based update `step` (nanoGPT's get_lr shape)."""
    if step <= cfg.warmup_steps:  # 1) linear warmup; step 1 already moves (no zero-lr step)
        return cfg.lr * step / cfg.warmup_steps
    min_lr = cfg.lr * cfg.min_lr_ratio
    if step >= cfg.total_steps:  # 2) past the end: hold the floor
        return min_lr
    # 3) cosine from lr (at warmup_steps) down to min_lr (at total_steps)
    ratio = (step - cfg.warmup_steps) / (cfg.total_steps - cfg.warmup_steps)
    coeff = 0.5 * (1.0 + math.cos(math.pi * ratio))  # 1 -> 0
    return min_lr + coeff * (cfg.lr - min_lr)


def group_lrs(step: int, cfg: LoraPlusConfig) -> tuple[float, float]:
    """(lr_a, lr_b) for update `step`: LoRA+ scales the whole schedule of group B."""
    lr = lr_at(step, cfg)
    return lr, lr * cfg.loraplus_ratio


# parameter groups: group_of and decays, PEFT's LoRA+ rule, are imported above from lorac.core
# (the optimizer graph asks the same two functions)


# -- clipping ----------------------------------------------------------------------------
def global_norm(grads: dict[str, np.ndarray]) -> float:
    """sqrt of the sum of squares over every gradient (float64 accumulation)."""
    return math.sqrt(sum(float(np.sum(np.square(g, dtype=np.float64))) for g in grads.values()))


def clip_scale(norm: float, max_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_'s factor: min(1, max_norm / (norm + 1e-6))."""
    if max_norm <= 0:
        return 1.0
    return min(1.0, max_norm / (norm + 1e-6))


def clip_by_global_norm(grads: dict[str, np.ndarray], max_norm: float) -> tuple[dict[str, np.ndarray], float]:
    """Scaled copies of `grads` with global norm <= max_norm, and the norm before clipping."""
    norm = global_norm(grads)
    c = clip_scale(norm, max_norm) if math.isfinite(norm) else 1.0
    return {k: (g * c).astype(np.float32) for k, g in grads.items()}, norm


# -- the step ----------------------------------------------------------------------------
@dataclass
class StepResult:
    params: dict[str, np.ndarray]
    m: dict[str, np.ndarray]
    v: dict[str, np.ndarray]
    grad_norm: float
    skipped: bool  # True: non-finite gradients, nothing applied, do not advance `step`


def init_state(params: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Zero first and second moments, float32, one per parameter."""
    return ({k: np.zeros_like(p, dtype=np.float32) for k, p in params.items()},
            {k: np.zeros_like(p, dtype=np.float32) for k, p in params.items()})


def adamw_step_reference(params, grads, m, v, step: int, lr_a: float, lr_b: float,
                         cfg: LoraPlusConfig) -> StepResult:
    """One LoRA+ AdamW update in float64, returned as float32 (see the module docstring).

    Inputs are not modified. `step` is 1-based: the first update uses step=1.
    """
    if step < 1:
        raise LoracError(f"optimizer step must be >= 1 (1-based), got {step}")
    norm = global_norm(grads)
    if not math.isfinite(norm):
        same = lambda d: {k: np.array(x, dtype=np.float32) for k, x in d.items()}  # noqa: E731
        return StepResult(same(params), same(m), same(v), norm, True)
    c = clip_scale(norm, cfg.max_grad_norm)
    b1, b2 = cfg.betas
    bc1, bc2 = 1.0 - b1 ** step, 1.0 - b2 ** step
    new_p, new_m, new_v = {}, {}, {}
    for k, p in params.items():
        p64 = p.astype(np.float64)
        g = grads[k].astype(np.float64) * c
        mk = b1 * m[k].astype(np.float64) + (1.0 - b1) * g
        vk = b2 * v[k].astype(np.float64) + (1.0 - b2) * g * g
        lr = lr_b if group_of(k, p.ndim) == "B" else lr_a
        wd = cfg.weight_decay if decays(k, p.ndim) else 0.0
        update = (mk / bc1) / (np.sqrt(vk / bc2) + cfg.eps) + wd * p64
        new_p[k] = (p64 - lr * update).astype(np.float32)
        new_m[k] = mk.astype(np.float32)
        new_v[k] = vk.astype(np.float32)
    return StepResult(new_p, new_m, new_v, norm, False)
