"""The LoRA+ parameter-group rule and the AdamW settings an optimizer graph bakes in.

The rule is PEFT's create_loraplus_optimizer: a tensor named `lora_B`, or any 1-D trainable,
learns at lr_B = ratio * lr_A; 1-D tensors (norms, biases) take no weight decay. The runtime's
numpy reference (runtime/train/optim.py) and the optimizer graph (graphs/optimizer.py) both ask
these two functions, so they cannot disagree.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from .constants import LORA_B


def group_of(name: str, ndim: int = 2) -> str:
    """'B' for lora_B matrices and any 1-D tensor, else 'A'.

    PEFT's rule (`"lora_B" in name or param.ndim == 1`): 1-D trainables (biases, norms) share
    B's learning rate. PEFT's separate embedding group (LoRA on nn.Embedding, lr 1e-6) does
    not arise: lorac adapts linear layers only.
    """
    return "B" if (LORA_B in name or ndim == 1) else "A"


def decays(name: str, ndim: int = 2) -> bool:
    """Whether weight decay applies: PEFT puts 1-D tensors (norms, biases) in a no-decay group."""
    return ndim >= 2 and "bias" not in name


@dataclass(frozen=True)
class AdamWConstants:
    """The settings compiled into an optimizer graph as constants: exactly what
    graphs/optimizer.build_optimizer_graph reads, and with every field the artifact's cache
    key (the engine builds the graph from this object alone, so a setting the key misses
    cannot reach the graph). Learning rates and the step count are graph inputs instead."""
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    max_grad_norm: float

    @classmethod
    def of(cls, cfg) -> "AdamWConstants":
        """The baked part of an optimizer config (runtime/optim.LoraPlusConfig)."""
        return cls(**{f.name: (tuple(float(b) for b in cfg.betas) if f.name == "betas" else float(getattr(cfg, f.name)))
                      for f in fields(cls)})
