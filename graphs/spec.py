"""Model and training specs: what the graph computes, validated before any node is emitted.

`ModelSpec.from_hf_config` reads a parsed HF config.json; every field that would change
the math but that lorac does not implement is refused with a ValueError naming it, so a
graph never silently computes something other than the model it claims to be.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

DECODER_ARCHS = ("llama", "mistral", "qwen2", "qwen3")
ATTN_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
ALL_TARGETS = ATTN_TARGETS + MLP_TARGETS
PACKINGS = ("plain", "isolated")  # TrainSpec.packing


@dataclass(frozen=True)
class ModelSpec:
    arch: str  # "llama" | "mistral" | "qwen2" | "qwen3"
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    tied: bool = True
    qkv_bias: bool = False  # qwen2: q/k/v biases
    o_bias: bool = False  # llama attention_bias=True: o_proj has a bias too
    qk_norm: bool = False  # qwen3: RMSNorm over head_dim on q and k before RoPE
    sliding_window: int | None = None  # mistral; only legal when seq <= window
    bos_id: int | None = None
    eos_id: int | None = None

    @property
    def group(self) -> int:
        """Query heads per KV head (GQA ratio)."""
        return self.heads // self.kv_heads

    @property
    def targets(self) -> tuple[str, ...]:
        return ALL_TARGETS

    def proj_shape(self, target: str) -> tuple[int, int]:
        """[out, in] of a projection, as HF stores it."""
        d, hd = self.hidden, self.head_dim
        return {
            "q_proj": (self.heads * hd, d), "k_proj": (self.kv_heads * hd, d),
            "v_proj": (self.kv_heads * hd, d), "o_proj": (d, self.heads * hd),
            "gate_proj": (self.intermediate, d), "up_proj": (self.intermediate, d),
            "down_proj": (d, self.intermediate),
        }[target]

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "ModelSpec":
        arch = cfg.get("model_type")
        if arch == "mamba":  # the selective state-space family has its own spec (graphs/mamba_spec.py)
            from .mamba_spec import MambaSpec
            return MambaSpec.from_hf_config(cfg)
        if arch not in DECODER_ARCHS:
            raise ValueError(f"unsupported architecture model_type={arch!r}; lorac supports {', '.join(DECODER_ARCHS)}")
        _refuse_unsupported(cfg, arch)
        hidden, heads = count_field(cfg, "hidden_size"), count_field(cfg, "num_attention_heads")
        kv = count_field(cfg, "num_key_value_heads", heads) if cfg.get("num_key_value_heads") is not None else heads
        head_dim = count_field(cfg, "head_dim") if cfg.get("head_dim") is not None else hidden // heads
        if head_dim < 1:
            raise ValueError(f"config.json: hidden_size={hidden} is smaller than num_attention_heads={heads}")
        if heads % kv:
            raise ValueError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}")
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", arch == "mistral") else None
        bias = bool(cfg.get("attention_bias", False))
        return cls(
            arch=arch, vocab=count_field(cfg, "vocab_size"), hidden=hidden, layers=count_field(cfg, "num_hidden_layers"),
            heads=heads, kv_heads=kv, head_dim=head_dim, intermediate=count_field(cfg, "intermediate_size"),
            rope_theta=_rope_theta(cfg),
            rms_eps=number_field(cfg, "rms_norm_eps", 1e-6),
            tied=bool(cfg.get("tie_word_embeddings", arch != "llama" and arch != "mistral")),
            qkv_bias=arch == "qwen2" or bias, o_bias=bias and arch != "qwen2", qk_norm=arch == "qwen3",
            sliding_window=int(window) if window else None,
            bos_id=cfg.get("bos_token_id"), eos_id=_first(cfg.get("eos_token_id")),
        )


def _first(x):
    return x[0] if isinstance(x, (list, tuple)) and x else x


def count_field(cfg: dict, key: str, default=None) -> int:
    """A positive integer field of config.json; missing or anything else: a ValueError naming it."""
    v = cfg.get(key, default)
    if v is None:
        raise ValueError(f"config.json has no {key}")
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"config.json field {key}={v!r} must be a positive integer")
    return v


def number_field(cfg: dict, key: str, default=None) -> float:
    """A finite positive number field of config.json."""
    v = cfg.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ValueError(f"config.json field {key}={v!r} must be a positive number")
    return float(v)


def _rope_theta(cfg: dict) -> float:
    # transformers 5 moved rope settings into `rope_parameters`; 4.x kept `rope_theta`
    params = cfg.get("rope_parameters") or {}
    return number_field(params if "rope_theta" in params else cfg, "rope_theta", 10000.0)


def _refuse_unsupported(cfg: dict, arch: str) -> None:
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"unsupported config field hidden_act={act!r} (only 'silu' / SwiGLU)")
    for key in ("rope_scaling", "rope_parameters"):
        rs = cfg.get(key) or {}
        if not isinstance(rs, dict):
            raise ValueError(f"config.json field {key} must be an object, got {type(rs).__name__}")
        kind = rs.get("rope_type", rs.get("type", "default"))
        if kind != "default":
            raise ValueError(f"unsupported config field {key}: rope_type={kind!r} (only plain RoPE)")
    if cfg.get("mlp_bias"):
        raise ValueError("unsupported config field mlp_bias=True")
    if cfg.get("pretraining_tp", 1) not in (1, None):
        raise ValueError(f"unsupported config field pretraining_tp={cfg['pretraining_tp']}")
    if arch == "qwen3" and cfg.get("attention_bias"):
        raise ValueError("unsupported config field attention_bias=True for qwen3")
    layer_types = cfg.get("layer_types")
    if layer_types is not None and not isinstance(layer_types, list):
        raise ValueError(f"config.json field layer_types must be a list, got {type(layer_types).__name__}")
    if layer_types and any(t != "full_attention" for t in layer_types) and cfg.get("use_sliding_window"):
        raise ValueError("unsupported config field layer_types: sliding-window layers are not implemented")


@dataclass(frozen=True)
class TrainSpec:
    batch: int
    seq: int
    lora_targets: tuple[str, ...] = ("q_proj", "v_proj")
    rank: int = 8
    alpha: float = 16.0
    rslora: bool = False
    trained_layers: range | tuple[int, ...] | None = None  # None: every layer
    checkpointing: bool = False
    loss_chunk: int = 0  # tokens per cross-entropy chunk; 0 = one chunk (see loss.py)
    # "isolated": rows pack several documents and the graphs take `position_ids` [B, S]: each
    # document attends only within itself and RoPE restarts at its start (docs/DATA.md)
    packing: str = "plain"
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def scale(self) -> float:
        """LoRA scale s in W_eff = W + s·B·A (PEFT: alpha/r, rsLoRA: alpha/sqrt(r))."""
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

    def layers(self, spec: ModelSpec) -> tuple[int, ...]:
        """Sorted indices of the layers that carry LoRA tensors."""
        return tuple(range(spec.layers)) if self.trained_layers is None else tuple(sorted(set(self.trained_layers)))

    def validate(self, spec: ModelSpec) -> None:
        for name in ("batch", "seq", "rank"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise ValueError(f"{name} must be an integer, got {v!r}")
        if self.batch < 1:
            raise ValueError(f"batch must be >= 1, got {self.batch}")
        if self.seq < 2:
            raise ValueError(f"seq must be >= 2 (next-token loss needs two positions), got {self.seq}")
        if self.rank <= 0:
            raise ValueError(f"rank must be > 0, got {self.rank}")
        if not math.isfinite(self.alpha) or self.alpha <= 0:
            raise ValueError(f"alpha must be a finite positive number, got {self.alpha}")
        if not self.lora_targets:
            raise ValueError(f"lora_targets is empty; valid targets: {', '.join(spec.targets)}")
        bad = [t for t in self.lora_targets if t not in spec.targets]
        if bad:
            raise ValueError(f"LoRA target(s) {', '.join(bad)} not in a {spec.arch} model; valid targets: {', '.join(spec.targets)}")
        if len(set(self.lora_targets)) != len(self.lora_targets):
            raise ValueError(f"lora_targets has duplicates: {self.lora_targets}")
        layers = self.layers(spec)
        if not layers or layers[0] < 0 or layers[-1] >= spec.layers:
            raise ValueError(f"trained_layers={self.trained_layers!r} must be non-empty indices in [0, {spec.layers})")
        if spec.sliding_window is not None and self.seq > spec.sliding_window:
            raise ValueError(f"seq={self.seq} exceeds sliding_window={spec.sliding_window}; sliding-window attention is not implemented")
        if self.loss_chunk < 0:
            raise ValueError(f"loss_chunk must be >= 0, got {self.loss_chunk}")
        if self.packing not in PACKINGS:
            raise ValueError(f"packing must be one of {', '.join(PACKINGS)}, got {self.packing!r}")
        if self.packing == "isolated" and spec.arch == "mamba":
            raise ValueError("--packing isolated is not implemented for Mamba (its conv and scan carry state "
                             "across documents); use --packing plain")


def lora_name(layer: int, target: str, which: str) -> str:
    """PEFT's saved key for a LoRA tensor, `which` in {"A", "B"}."""
    block = "self_attn" if target in ATTN_TARGETS else "mlp"
    return f"base_model.model.model.layers.{layer}.{block}.{target}.lora_{which}.weight"


def weight_name(layer: int, target: str, kind: str = "weight") -> str:
    block = "self_attn" if target in ATTN_TARGETS else "mlp"
    return f"model.layers.{layer}.{block}.{target}.{kind}"
