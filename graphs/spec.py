"""Model and training specs: what the graph computes, validated before any node is emitted.

`ModelSpec` holds what an attention decoder's graph needs; each model family
(graphs/families/) builds its spec from a parsed HF config.json, refusing every field that
would change the math but that lorac does not implement with a ValueError naming it, so a
graph never silently computes something other than the model it claims to be.
`ALL_TARGETS` are the Llama-like decoders' targets; other families have their own
(`spec.targets`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

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
    sliding_window: int | None = None  # mistral, phi3: query i sees keys i - window < j <= i
    logit_softcap: float | None = None  # final logits c tanh(z / c) (gemma2)
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
    def from_hf_config(cls, cfg: dict):
        """The spec of a parsed HF config.json, built by its model family (graphs/families/):
        a ModelSpec, or the family's own spec class (MambaSpec)."""
        from .families import spec_from_hf_config
        return spec_from_hf_config(cfg)


def first(x):
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


def rope_theta(cfg: dict) -> float:
    # transformers 5 moved rope settings into `rope_parameters`; 4.x kept `rope_theta`
    params = cfg.get("rope_parameters") or {}
    return number_field(params if "rope_theta" in params else cfg, "rope_theta", 10000.0)


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
    keep_layers: int = 0  # with checkpointing: the highest trained layers that keep their activations
    offload: bool = False  # with checkpointing: recomputed layers' kept inputs wait in host memory (offload.py)
    # with offload, a recomputed layer also moves what its attention's backward reads (q, k, v, the
    # output, the row statistics) to host memory, and its backward recomputes only the MLP half;
    # None (the default) = where the family says the copies hide behind the forward
    # (decoder.state_offload_pays); True / False: always / never (docs/RUNTIME.md, Offload)
    offload_state: bool | None = None
    # with the attention state offloaded: that many recomputed layers (the highest ones) also keep
    # their MLP's gate and up on the device, so their backward recomputes no GEMM (2 [N, I] values a
    # layer, ~60 % of a kept layer's); runtime/train/memory.py chooses it under --checkpointing auto
    keep_mlp: int = 0
    loss_chunk: int = 0  # tokens per cross-entropy chunk; 0 = one chunk (see loss.py)
    # "isolated": rows pack several documents and the graphs take `position_ids` [B, S]: each
    # document attends only within itself and RoPE restarts at its start (docs/DATA.md)
    packing: str = "plain"
    # frozen weights that arrive quantized: (HF weight name, graphs.quant.Quant) pairs, sorted; the
    # graph reads their blocks and dequantizes before each GEMM (graphs/ops/quant.py): linear
    # weights, and the embedding / LM head (read by rows and in vocabulary slices)
    quant: tuple = ()
    # vocabulary slices a quantized LM head is read in (0: graphs/ops/loss.py head_slices picks ~96 MB
    # dense bf16 slices); a dense head is one GEMM and ignores it
    head_slices: int = 0
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def scale(self) -> float:
        """LoRA scale s in W_eff = W + s·B·A (PEFT: alpha/r, rsLoRA: alpha/sqrt(r))."""
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

    def layers(self, spec: ModelSpec) -> tuple[int, ...]:
        """Sorted indices of the layers that carry LoRA tensors."""
        return tuple(range(spec.layers)) if self.trained_layers is None else tuple(sorted(set(self.trained_layers)))

    def recomputes(self, spec: ModelSpec, layer: int) -> bool:
        """Whether the backward recomputes `layer`'s forward from its input (checkpointing).
        keep_layers > 0 keeps the activations of that many of the highest trained layers:
        between no checkpointing's speed and full checkpointing's memory."""
        return layer in self.recomputed_layers(spec)

    def recomputed_layers(self, spec: ModelSpec) -> tuple[int, ...]:
        """The trained layers the backward recomputes, bottom up (recomputes)."""
        if not self.checkpointing:
            return ()
        trained = self.layers(spec)
        return trained[:max(len(trained) - self.keep_layers, 0)]

    def keeps_mlp(self, spec: ModelSpec, layer: int) -> bool:
        """Whether recomputed `layer` keeps its MLP's gate and up (mlp_kept_layers)."""
        return layer in self.mlp_kept_layers(spec)

    def mlp_kept_layers(self, spec: ModelSpec) -> tuple[int, ...]:
        """The recomputed layers that keep their MLP's gate and up: the keep_mlp highest of them."""
        recomputed = self.recomputed_layers(spec) if self.keep_mlp else ()
        return recomputed[max(len(recomputed) - self.keep_mlp, 0):]

    def quant_of(self, name: str):
        """The Quant of frozen weight `name`, or None where it is dense."""
        return dict(self.quant).get(name)

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
        if not isinstance(self.keep_layers, int) or self.keep_layers < 0:
            raise ValueError(f"keep_layers (--keep-layers) must be an integer >= 0, got {self.keep_layers!r}")
        if self.keep_layers and not self.checkpointing:
            raise ValueError("--keep-layers is for --checkpointing (it keeps some layers' activations); "
                             "without checkpointing every layer keeps them")
        if self.offload and not self.checkpointing:
            raise ValueError("offload moves the inputs checkpointing keeps to host memory; it needs checkpointing")
        if not isinstance(self.keep_mlp, int) or isinstance(self.keep_mlp, bool) or self.keep_mlp < 0:
            raise ValueError(f"keep_mlp (--keep-mlp) must be an integer >= 0, got {self.keep_mlp!r}")
        if self.keep_mlp and not (self.offload and self.offload_state is not False):
            raise ValueError("--keep-mlp keeps the MLP half of layers whose attention state waits in host memory; "
                             "it needs --checkpointing offload with the attention state offloaded")
        if self.offload_state not in (None, True, False):
            raise ValueError(f"offload_state must be None, True or False, got {self.offload_state!r}")
        if not isinstance(self.head_slices, int) or isinstance(self.head_slices, bool) or self.head_slices < 0:
            raise ValueError(f"head_slices must be an integer >= 0, got {self.head_slices!r}")
        if self.loss_chunk < 0:
            raise ValueError(f"loss_chunk must be >= 0, got {self.loss_chunk}")
        if self.packing not in PACKINGS:
            raise ValueError(f"packing must be one of {', '.join(PACKINGS)}, got {self.packing!r}")
        from .families import for_spec
        if self.packing == "isolated" and not for_spec(spec).PACKING_ISOLATED:
            raise ValueError(f"--packing isolated is not implemented for {spec.arch} (its layers carry state "
                             "across documents); use --packing plain")


def lora_name(layer: int, target: str, which: str) -> str:
    """PEFT's saved key for a LoRA tensor, `which` in {"A", "B"}."""
    block = "self_attn" if target in ATTN_TARGETS else "mlp"
    return f"base_model.model.model.layers.{layer}.{block}.{target}.lora_{which}.weight"


def weight_name(layer: int, target: str, kind: str = "weight") -> str:
    block = "self_attn" if target in ATTN_TARGETS else "mlp"
    return f"model.layers.{layer}.{block}.{target}.{kind}"
