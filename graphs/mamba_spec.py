"""Mamba-1 model spec (HF `MambaForCausalLM` configs), validated before any node is emitted.

Like `ModelSpec`, every config field that would change the math but that lorac does not
implement is refused with a ValueError naming it. The shared `TrainSpec` validates LoRA
targets against `spec.targets` and sizes LoRA tensors with `spec.proj_shape`, so a
`MambaSpec` plugs into it unchanged.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .spec import count_field, number_field

MAMBA_TARGETS = ("in_proj", "x_proj", "dt_proj", "out_proj")


@dataclass(frozen=True)
class MambaSpec:
    vocab: int
    hidden: int  # D
    layers: int
    state: int  # M: SSM state size per channel (HF state_size)
    intermediate: int  # I = expand * hidden
    conv_kernel: int  # K
    dt_rank: int  # R (HF time_step_rank; "auto" = ceil(hidden / 16))
    use_bias: bool = False  # biases on in_proj and out_proj
    conv_bias: bool = True
    rms_eps: float = 1e-5
    tied: bool = True
    bos_id: int | None = None
    eos_id: int | None = None
    arch: str = "mamba"
    logit_softcap: None = None  # the head's logits are not soft-capped

    @property
    def targets(self) -> tuple[str, ...]:
        return MAMBA_TARGETS

    @property
    def default_targets(self) -> tuple[str, ...]:
        """LoRA on all four projections unless told otherwise (TrainSpec's own default is a decoder's)."""
        return MAMBA_TARGETS

    def proj_shape(self, target: str) -> tuple[int, int]:
        """[out, in] of a projection, as HF stores it."""
        d, i, m, r = self.hidden, self.intermediate, self.state, self.dt_rank
        return {"in_proj": (2 * i, d), "x_proj": (r + 2 * m, i), "dt_proj": (i, r), "out_proj": (d, i)}[target]

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "MambaSpec":
        if cfg.get("model_type") != "mamba":
            raise ValueError(f"not a Mamba-1 config: model_type={cfg.get('model_type')!r}")
        _refuse_unsupported(cfg)
        hidden = count_field(cfg, "hidden_size")
        inter = _intermediate(cfg, hidden)
        rank = cfg.get("time_step_rank", "auto")
        rank = math.ceil(hidden / 16) if rank == "auto" else rank
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
            raise ValueError(f"unsupported config field time_step_rank={rank!r} (an integer >= 1 or 'auto')")
        kernel = count_field(cfg, "conv_kernel", 4)
        return cls(
            vocab=count_field(cfg, "vocab_size"), hidden=hidden, layers=count_field(cfg, "num_hidden_layers"),
            state=count_field(cfg, "state_size", 16), intermediate=inter, conv_kernel=kernel, dt_rank=rank,
            use_bias=bool(cfg.get("use_bias", False)), conv_bias=bool(cfg.get("use_conv_bias", True)),
            rms_eps=number_field(cfg, "layer_norm_epsilon", 1e-5), tied=bool(cfg.get("tie_word_embeddings", True)),
            bos_id=cfg.get("bos_token_id"), eos_id=_first(cfg.get("eos_token_id")),
        )


def _intermediate(cfg: dict, hidden: int) -> int:
    # HF recomputes intermediate_size = int(expand * hidden_size) and ignores a stored value;
    # a config where the two disagree is ambiguous, so it is refused rather than guessed.
    inter = count_field(cfg, "intermediate_size") if cfg.get("intermediate_size") is not None else None
    if "expand" in cfg or inter is None:
        from_expand = count_field({"expand * hidden_size": int(min(number_field(cfg, "expand", 2) * hidden, 2**62))},
                                  "expand * hidden_size")
        if inter is not None and inter != from_expand:
            raise ValueError(f"unsupported config: intermediate_size={inter} disagrees with expand*hidden_size={from_expand}")
        return from_expand
    return inter


def _refuse_unsupported(cfg: dict) -> None:
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"unsupported config field hidden_act={act!r} (only 'silu')")
    if cfg.get("rms_norm") is False:  # mamba_ssm-style configs: LayerNorm instead of RMSNorm
        raise ValueError("unsupported config field rms_norm=False (only RMSNorm)")
    ssm = cfg.get("ssm_cfg") or {}
    if not isinstance(ssm, dict):
        raise ValueError(f"config.json field ssm_cfg must be an object, got {type(ssm).__name__}")
    if ssm.get("layer", "Mamba1") != "Mamba1":
        raise ValueError(f"unsupported config field ssm_cfg.layer={ssm['layer']!r} (only Mamba1)")


def _first(x):
    return x[0] if isinstance(x, (list, tuple)) and x else x


def lora_name(layer: int, target: str, which: str) -> str:
    """PEFT's saved key for a LoRA tensor of a Mamba mixer projection, `which` in {"A", "B"}."""
    return f"base_model.model.backbone.layers.{layer}.mixer.{target}.lora_{which}.weight"


def weight_name(layer: int, part: str) -> str:
    """HF's name of a mixer tensor: `in_proj.weight`, `conv1d.bias`, `A_log`, `D`, ..."""
    return f"backbone.layers.{layer}.mixer.{part}"
