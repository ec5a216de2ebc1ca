"""TrainConfig: every setting of `lorac train` with its default, its reason and its help line."""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

from lorac.core.constants import CACHE_DIR
from lorac.core.settings import like, setting
from lorac.graphs import families
from lorac.graphs.spec import PACKINGS

from . import devices
from .errors import LoracError
from .train.optim import LoraPlusConfig

QUANTIZE = ("nf4", "int8")  # --quantize
QUANTIZED_BASE = ("auto", "keep", "dequantize")  # --quantized-base
QUANTIZE_EMBEDDINGS = ("auto", "off", "nf4", "int8")  # --quantize-embeddings

CPU = "cpu"  # the default --target: every machine has one
# Sane ranges: (low, high, low included). Wider values are finite but only make every update
# non-finite (every step skipped) or throw the adapter away in one step: lr 1 already moves each
# LoRA value by about 1 per step; the LoRA scale alpha/r of common recipes is 0.25-4, LoRA+'s
# ratio at most 2^8 in its paper; AdamW's decoupled decay beyond 1 flips the weights' sign.
BOUNDS = {"lr": (0.0, 1.0, False), "loraplus_ratio": (0.0, 1000.0, False), "weight_decay": (0.0, 1.0, True),
          "alpha": (0.0, 1000.0, False)}
CHECKPOINTING = ("auto", "on", "off", "offload")
OFFLOAD_STATE = {"auto": None, "on": True, "off": False}  # --offload-state -> TrainSpec.offload_state
OFFLOAD_EMBEDDINGS = ("auto", "on", "off")
OFFLOAD_STATE_DEFAULT = "auto"


@dataclass
class TrainConfig:
    """Every setting of `lorac train`, one field each: its default, its reason (a comment) and
    its help line live here and nowhere else (the CLI makes one flag per field, --help shows
    the defaults; the optimizer's fields come from LoraPlusConfig, runtime/train/optim.py)."""
    model: str | None = setting(
        None, "HF model directory, .gguf file, or hub id ORG/NAME (ORG/NAME:Q4_K_M for a GGUF repo; the local HF "
        "cache first) (default: the bundled SmolLM2-135M-Instruct)")
    data: str | None = setting(
        None, "training data: .txt, .jsonl/.json (text, prompt/completion, chat messages, alpaca, sharegpt), "
        ".parquet/.arrow, a dataset folder, or a hub dataset ORG/NAME[:SPLIT] (default: the bundled Jargon File "
        "Q&A corpus)")
    eval_data: str | None = setting(None, "held-out data file (default: every 1/eval-fraction-th document of --data)")
    out: str = setting("lorac-out", "output directory: metrics.jsonl, loss.png, checkpoints/, adapter/ (locked "
                       "while a run writes there)")
    # 40 steps of 4x128 tokens: the bundled demo shows its loss fall in a few minutes on a laptop CPU
    steps: int = setting(40, "optimizer steps")
    batch: int = setting(4, "sequences per micro-batch; with --gpus N, of all workers together "
                         "(--per-device-train-batch-size: per worker, as in TRL)")
    seq: int = setting(128, "tokens per sequence")
    # "auto": isolated where the family has it, plain for Mamba (train/plan.py resolve_packing; docs/DATA.md)
    packing: str = setting("auto", "how documents share a packed row: isolated (each attends only within itself "
                           "and its positions restart, as TRL's padding-free packing), plain (attention crosses "
                           "documents), or auto: isolated, but plain for Mamba, whose layers carry state across "
                           "documents (docs/DATA.md)")
    # "none": today's stream packing, unchanged data for old runs and checkpoints (runtime/data/fit.py)
    truncate: str = setting("none", "prompt-left: cut prompts longer than a row from the left (the answer is kept) "
                            "and keep each example that fits within one row, padding the rest of a row; none: "
                            "documents run on across row ends (docs/DATA.md)")
    rank: int = setting(16, "LoRA rank r")
    alpha: float = setting(32.0, "LoRA alpha: the LoRA scale alpha/r (alpha/sqrt(r) with --rslora) must lie in "
                           "(0, 1000]")  # s = alpha/r = 2, PEFT's common r=16/alpha=32 pairing
    rslora: bool = setting(False, "scale alpha/sqrt(r) (rsLoRA)")
    # None: every linear layer of the family (QLoRA/LoRA+ practice). Named lora_targets (as
    # TrainSpec's) so it is not one letter from `target`, the device; the flag stays --targets
    lora_targets: tuple[str, ...] | None = setting(
        None, "comma-separated LoRA targets (default: every linear layer of the model's family: "
        + "; ".join(f"{','.join(f.TARGETS)} for {'/'.join(f.MODEL_TYPES)}" for f in families.families()) + ")",
        flag="--targets")
    # QLoRA (graphs/ops/quant.py): the base's linear projections held as quantized blocks, each
    # dequantized just before the GEMMs that read it; "auto": the device's default (runtime/devices/)
    quantize: str | None = setting(None, "quantize the frozen linear projections on load: nf4 (QLoRA's 4-bit "
                                   "NormalFloat in bitsandbytes' layout, block 64, double-quantized absmax) or int8 "
                                   "(per output channel); the graph dequantizes each weight just before its GEMMs. "
                                   "Weights the model holds quantized already (a GGUF's blocks) keep their own "
                                   "(docs/WEIGHTS.md)")
    quantized_base: str = setting("auto", "how a quantized base (a *-bnb-4bit model, a quantized GGUF, --quantize) "
                                  "is held: keep (its blocks: QLoRA's memory), dequantize (dense from load) or auto: "
                                  "keep on cuda; on cpu dequantize (the faster step) unless the dense weights would "
                                  "take more than half of the free memory (--dequantize: the same as dequantize)")
    # the embedding and LM head stay dense unless asked, or unless auto finds that only quantizing
    # them fits the budget (train/plan.py; runtime/model/quant/embeddings.py)
    quantize_embeddings: str = setting(
        "auto", "hold the input embedding and an untied LM head quantized: nf4 (block 64, a float32 absmax "
        "per block; the hidden size must be a multiple of 64), int8 (a scale per vocabulary row), off, or auto: off, "
        "but nf4 where the base is kept quantized and --checkpointing auto finds no setting within the memory "
        "budget with dense embeddings; lookups dequantize only the rows they read, the LM head is read in "
        "vocabulary slices of ~96 MB (docs/WEIGHTS.md)")
    trained_layers: str | None = setting(None, "adapt only layers A:B, or the layers i,j,k (no backward below the "
                                         "first)")  # "A:B": layers A..B-1 only (frozen prefix below A)
    lr: float = like(LoraPlusConfig, "lr", optimizer=True)
    loraplus_ratio: float = like(LoraPlusConfig, "loraplus_ratio", optimizer=True)
    warmup: int = like(LoraPlusConfig, "warmup_steps", optimizer=True)
    weight_decay: float = like(LoraPlusConfig, "weight_decay", optimizer=True)
    max_grad_norm: float = like(LoraPlusConfig, "max_grad_norm", optimizer=True)
    grad_accum: int = setting(1, "micro-batches per optimizer step")
    target: str = setting(CPU, f"where to train: {', '.join(devices.targets())} (runtime/devices/; docs/TARGETS.md: "
                          "a target whose runtime this machine lacks is refused at once, and --compile-only builds "
                          "for any; webgpu trains through onnxruntime's WebGPU plugin, --backend ort: pip install "
                          "'lorac[webgpu]')")
    dtype: str | None = setting(None, "float32 or bfloat16 (default: float32 on cpu, bfloat16 on cuda; --backend "
                                "ort: float32)")
    backend: str = setting("tvm", "tvm (compiled artifacts) or ort (the same graphs on onnxruntime: pip install "
                           "'lorac[ort]')")  # "ort": runtime/engine/ort.py
    ort_providers: str | None = setting(
        None, "--backend ort: comma-separated onnxruntime execution providers, e.g. "
        "CUDAExecutionProvider,CPUExecutionProvider or cuda,cpu, or webgpu (the same as --target webgpu) "
        "(default: cpu's, cuda's or webgpu's, by --target)")
    # "auto": the fastest setting whose estimated memory fits the GPU (runtime/train/memory.py);
    # a bare --checkpointing means on, as when the flag was a switch
    checkpointing: str = setting("auto", "recompute layers' forwards in the backward (less memory): on, off, "
                                 "offload (on, and the recomputed layers' inputs wait in pinned host memory: cuda), "
                                 "or auto: on cuda the fastest setting (none, or the most --keep-layers, offloaded "
                                 "or not) whose estimated memory fits the GPU's free memory or --memory-budget; off "
                                 "elsewhere (docs/RUNTIME.md)", bare="on")
    offload_state: str = setting(OFFLOAD_STATE_DEFAULT, "with offloaded checkpointing (cuda), the recomputed layers' "
                                 "attention state (q, k, v, its output and statistics, the residual sum after it, the norms' "
                                 "rstd) waits in host memory too, so their backward recomputes only the MLP's gate and "
                                 "up: on, off, or auto (where the host link "
                                 "keeps up with the forward: Llama-3-8B shapes and larger, unless only the inputs "
                                 "alone fit --checkpointing auto's budget; docs/GRAPHS.md)")
    # an untied model's input embedding in pinned host memory, read by the lookup in place
    # (runtime/devices/cuda/mapped.py; runtime/train/plan.py resolves auto)
    offload_embeddings: str = setting("auto", "keep an untied model's input embedding table in pinned host memory, "
                                      "where the GPU reads the rows of each step's tokens over PCIe (1.05 GB of GPU "
                                      "memory freed at Llama-3-8B's shape, ~67 MB read a 4x2048 step): on, off, or "
                                      "auto: on where the step checkpoints (cuda; a tied table, also the LM head, "
                                      "stays on the GPU)")
    keep_layers: int = setting(0, "with checkpointing, the N highest layers keep their activations instead "
                               "(faster, more memory); given alone, turns checkpointing on")
    keep_mlp: int = setting(0, "with --checkpointing offload and the attention state offloaded, the N highest "
                            "recomputed layers keep their MLP's gate and up on the GPU, so their backward recomputes "
                            "nothing (about 0.6x the memory of a kept layer); --checkpointing auto chooses it")
    memory_budget: float | None = setting(None, "GB of device memory the run may use, for --checkpointing auto "
                                          "(default: the GPU's free memory less a reserve)", type=float)
    loss_chunk: int = setting(0, "tokens per cross-entropy chunk (0: one chunk on cpu; on cuda chunks whose fp32 "
                              "logits fit 1.5 GiB, on webgpu 512 MiB; --checkpointing auto may take smaller ones "
                              "to keep more layers)")
    scan_chunk: int = setting(0, "Mamba scan chunk length (0: the device's default, 64 on cpu and 16 on cuda; "
                              "graphs/mamba.py DEVICE_CHUNK)")
    eval_every: int = setting(10, "steps between evals")
    eval_batches: int = setting(4, "batches per eval (0: no eval)")
    save_every: int = setting(20, "steps between checkpoints")
    keep_checkpoints: int = setting(2, "checkpoints kept (at least 1)")
    seed: int = setting(0, "random seed (LoRA init and data order), an integer >= 0")
    resume: str | None = setting(None, "continue from a checkpoint directory (or OUT/checkpoints)")
    adapter: str | None = setting(None, "start from this PEFT adapter directory (its rank, alpha, targets and "
                                  "layers replace --rank, --alpha, --targets, --trained-layers)")
    cache_dir: str = setting(CACHE_DIR, "compiled-artifact cache")
    eval_fraction: float = setting(0.05, "share of documents held out for eval")
    sample_prompt: str | None = setting(None, "prompt for the before/after sample (default: one from the eval data)")
    sample_tokens: int = setting(32, "tokens generated for the sample (0: no sample)")
    compile_only: bool = setting(False, "compile every graph of the run for --target into --cache-dir and stop; "
                                 "copy the cache to the machine that trains (it needs no compiler then)")
    tune: int = setting(0, "MetaSchedule trials for the training step's TVM kernels, cpu or cuda (0: default "
                        "schedules; cuda tunes on this machine's GPU and needs nvcc; the database under "
                        "--cache-dir is reused by later runs; docs/COMPILER.md, Tuning)")
    no_cuda_graph: bool = setting(False, "cuda: run the training step as plain VM calls instead of CUDA graphs "
                                  "(graphs cut the host's work per step from ~15,000 calls to a few hundred)")
    progress: str = setting("auto", "auto (a bar on a terminal, a line per step elsewhere), bar or lines")
    report_to: str = setting("none", "none, or tensorboard (scalars to OUT/runs; pip install "
                             "'lorac[tensorboard]')")
    # 0: one process, or the MPI job's workers when started under mpiexec (runtime/dist/launch.py)
    gpus: int = setting(0, "data-parallel workers on this host: N processes through mpiexec, one per GPU with "
                        "--target cuda (CPU processes with --target cpu); --batch is the global batch, split over "
                        "them; several hosts: docs/DISTRIBUTED.md (pip install 'lorac[distributed]')")
    # 600 s: torch's NCCL default
    dist_timeout: float = setting(600.0, "seconds a worker waits for the others in a collective before the run "
                                  "stops with an error")
    extra: dict = setting(help="settings without a flag (API use)", factory=dict)

    @classmethod
    def optimizer_settings(cls) -> tuple[str, ...]:
        """The fields that shape the optimizer's trajectory (a resumed run must keep them)."""
        return tuple(f.name for f in fields(cls) if f.metadata.get("optimizer"))

    def optim_config(self) -> LoraPlusConfig:
        """The run's LoraPlusConfig (total_steps: --steps; the rest at LoraPlusConfig's defaults)."""
        return LoraPlusConfig(lr=self.lr, loraplus_ratio=self.loraplus_ratio, weight_decay=self.weight_decay,
                              max_grad_norm=self.max_grad_norm, warmup_steps=self.warmup, total_steps=self.steps)

    def validate(self):
        for key in ("steps", "batch", "seq", "rank", "grad_accum", "eval_every", "save_every", "eval_batches"):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v < (0 if key == "eval_batches" else 1):
                raise LoracError(f"--{key.replace('_', '-')} must be a positive integer, got {v!r}")
        for key in ("lr", "alpha", "loraplus_ratio", "weight_decay", "max_grad_norm", "eval_fraction"):
            v = getattr(self, key)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
                raise LoracError(f"--{key.replace('_', '-')} must be a finite number, got {v!r}")
        self.check_bounds()
        for key in ("warmup", "loss_chunk", "sample_tokens", "seed"):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise LoracError(f"--{key.replace('_', '-')} must be an integer >= 0, got {v!r}")
        if not isinstance(self.keep_checkpoints, int) or isinstance(self.keep_checkpoints, bool) or self.keep_checkpoints < 1:
            raise LoracError(f"--keep-checkpoints must be an integer >= 1 (the checkpoints kept; the one just "
                             f"written always stays), got {self.keep_checkpoints!r}")
        if self.lora_targets is not None and not [t for t in self.lora_targets if str(t).strip()]:
            raise LoracError(f"--targets {','.join(self.lora_targets)!r} names no LoRA target (leave it out for every "
                             "linear layer)")
        if not isinstance(self.scan_chunk, int) or isinstance(self.scan_chunk, bool) or self.scan_chunk < 0:
            raise LoracError(f"--scan-chunk must be an integer >= 0 (0: the device's default), got {self.scan_chunk!r}")
        if isinstance(self.checkpointing, bool):  # configs and checkpoints from when it was a switch
            self.checkpointing = "on" if self.checkpointing else "off"
        if self.checkpointing not in CHECKPOINTING:
            raise LoracError(f"--checkpointing must be auto, on, off or offload, got {self.checkpointing!r}")
        if self.checkpointing == "offload" and (self.backend != "tvm" or not getattr(
                devices.for_target(self.target), "OFFLOADS", False)):
            raise LoracError(f"--checkpointing offload keeps inputs in host memory beside a GPU; --target "
                             f"{self.target} --backend {self.backend} has no such device memory (use on)")
        if self.offload_embeddings not in OFFLOAD_EMBEDDINGS:
            raise LoracError(f"--offload-embeddings must be auto, on or off, got {self.offload_embeddings!r}")
        if self.offload_embeddings == "on" and (self.backend != "tvm" or getattr(
                devices.for_target(self.target), "host_table", None) is None):
            raise LoracError(f"--offload-embeddings on keeps the embedding in host memory beside a GPU; --target "
                             f"{self.target} --backend {self.backend} has no such device memory")
        if self.offload_state not in OFFLOAD_STATE:
            raise LoracError(f"--offload-state must be auto, on or off, got {self.offload_state!r}")
        if not isinstance(self.keep_layers, int) or isinstance(self.keep_layers, bool) or self.keep_layers < 0:
            raise LoracError(f"--keep-layers must be an integer >= 0, got {self.keep_layers!r}")
        if self.keep_layers and self.checkpointing == "off":
            raise LoracError("--keep-layers keeps some layers' activations under checkpointing; with "
                             "--checkpointing off every layer keeps them")
        if not isinstance(self.keep_mlp, int) or isinstance(self.keep_mlp, bool) or self.keep_mlp < 0:
            raise LoracError(f"--keep-mlp must be an integer >= 0, got {self.keep_mlp!r}")
        if self.keep_mlp and (self.checkpointing != "offload" or self.offload_state == "off"):
            raise LoracError("--keep-mlp keeps the MLP half of layers whose attention state waits in host memory: "
                             "it needs --checkpointing offload (and --offload-state auto or on)")
        if self.memory_budget is not None and (isinstance(self.memory_budget, bool) or not isinstance(
                self.memory_budget, (int, float)) or not 0 < self.memory_budget < math.inf):
            raise LoracError(f"--memory-budget must be a positive number of GB, got {self.memory_budget!r}")
        if not isinstance(self.tune, int) or isinstance(self.tune, bool) or self.tune < 0:
            raise LoracError(f"--tune must be an integer >= 0 (0: no tuning), got {self.tune!r}")
        if self.tune and (self.backend != "tvm" or self.target not in devices.tuned_targets()):
            raise LoracError(f"--tune tunes TVM's kernels for --target {' or '.join(devices.tuned_targets())}, not "
                             f"--backend {self.backend} --target {self.target}")
        if not isinstance(self.gpus, int) or isinstance(self.gpus, bool) or self.gpus < 0:
            raise LoracError(f"--gpus must be an integer >= 0, got {self.gpus!r}")
        if self.gpus > 1 and self.batch % self.gpus:
            raise LoracError(f"--batch {self.batch} is the global batch and must split evenly over --gpus {self.gpus}")
        if not isinstance(self.dist_timeout, (int, float)) or not 0 < self.dist_timeout < math.inf:
            raise LoracError(f"--dist-timeout must be a positive number of seconds, got {self.dist_timeout!r}")
        if not 0 <= self.eval_fraction < 1:
            raise LoracError(f"--eval-fraction must lie in [0, 1), got {self.eval_fraction}")
        if self.quantize not in (None,) + QUANTIZE:
            raise LoracError(f"--quantize must be {' or '.join(QUANTIZE)}, got {self.quantize!r}")
        if self.quantized_base not in QUANTIZED_BASE:
            raise LoracError(f"--quantized-base must be {', '.join(QUANTIZED_BASE)}, got {self.quantized_base!r}")
        if self.quantize and self.quantized_base == "dequantize":
            raise LoracError("--quantize keeps the base quantized; it cannot be combined with --dequantize")
        if self.quantize_embeddings not in QUANTIZE_EMBEDDINGS:
            raise LoracError(f"--quantize-embeddings must be {', '.join(QUANTIZE_EMBEDDINGS)}, got "
                             f"{self.quantize_embeddings!r}")
        if self.quantize_embeddings in ("nf4", "int8") and self.quantized_base == "dequantize":
            raise LoracError(f"--quantize-embeddings {self.quantize_embeddings} holds the embeddings quantized; it "
                             "cannot be combined with --dequantize")
        if self.packing not in ("auto",) + PACKINGS:
            raise LoracError(f"--packing must be auto, {' or '.join(PACKINGS)}, got {self.packing!r}")
        from .data.fit import check_truncation
        check_truncation(self.truncate)
        from .train.report import check_report_settings
        check_report_settings(self.progress, self.report_to)
        self.check_backend()

    def check_bounds(self):
        """The optimizer's and the LoRA's numbers within BOUNDS (a finite value far outside them
        only makes every gradient non-finite and every step skipped: --alpha 1e30)."""
        scale = self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank) if self.rank else self.alpha
        for key, value in (("lr", self.lr), ("loraplus_ratio", self.loraplus_ratio),
                           ("weight_decay", self.weight_decay), ("alpha", scale)):
            lo, hi, closed = BOUNDS[key]
            if not (lo <= value <= hi if closed else lo < value <= hi):
                what = f"the LoRA scale --alpha/{'sqrt(r)' if self.rslora else 'r'} = {scale:g}" if key == "alpha" \
                    else f"--{key.replace('_', '-')} {value:g}"
                raise LoracError(f"{what} must lie in {'[' if closed else '('}{lo:g}, {hi:g}]")

    def check_backend(self):
        """--target, --backend and --ort-providers, before anything loads: a target this machine
        cannot train on is one line here (runtime/devices/), not an error deep inside TVM."""
        if self.backend not in ("tvm", "ort"):
            raise LoracError(f"--backend must be tvm or ort, got {self.backend!r}")
        device = devices.for_target(self.target)  # an unknown target: one line naming the known ones
        # a device that trains through onnxruntime only (webgpu: its plugin; TVM's webgpu artifacts
        # run in browsers): --target webgpu is short for --backend ort --ort-providers webgpu, and
        # the reverse
        if device.TRAINS_ON and not self.compile_only:
            self.backend = device.TRAINS_ON
        elif self.backend == "ort" and self.target == CPU and devices.named_by_providers(self.ort_providers):
            device = devices.named_by_providers(self.ort_providers)
            self.target = device.TARGETS[0]
        if self.backend == "ort":
            if self.compile_only:
                raise LoracError("--compile-only fills the TVM artifact cache; --backend ort compiles nothing ahead")
            device.check_ort()  # webgpu: the plugin and an adapter, or one line now
        elif self.ort_providers:
            raise LoracError("--ort-providers is for --backend ort")
        elif not self.compile_only:
            devices.check_trainable(self.target)

    def train_spec(self, spec, *, workers: int = 1, loss_chunk: int | None = None, extra: dict | None = None,
                   quant: tuple = ()):
        """The TrainSpec these settings train `spec` with (the one place a TrainSpec is made from
        settings: runtime/train/plan.py, eval, generate, export --format onnx): a data-parallel
        worker's share of --batch; `loss_chunk` as resolved for the device (default --loss-chunk);
        `extra`: the model family's own options (train_extra); `quant`: the frozen weights held
        quantized (TrainSpec.quant, from the loaded weights)."""
        from lorac.graphs import TrainSpec
        return TrainSpec(batch=self.batch // workers, seq=self.seq, lora_targets=tuple(self.lora_targets or spec.targets),
                         rank=self.rank, alpha=self.alpha, rslora=self.rslora,
                         trained_layers=self.layer_range(spec.layers),
                         checkpointing=self.checkpointing in ("on", "offload"), offload=self.checkpointing == "offload",
                         offload_state=OFFLOAD_STATE[self.offload_state],
                         keep_layers=self.keep_layers, keep_mlp=self.keep_mlp,
                         loss_chunk=self.loss_chunk if loss_chunk is None else loss_chunk,
                         packing=self.packing, quant=tuple(quant), extra=dict(extra or {}))

    def layer_range(self, n_layers: int):
        if not self.trained_layers:
            return None
        try:
            if ":" not in self.trained_layers:  # a list of layers, as an adapter's layers_to_transform
                return tuple(int(x) for x in self.trained_layers.split(","))
            lo, hi = (int(x) if x else d for x, d in zip(self.trained_layers.split(":"), (0, n_layers)))
        except ValueError:
            raise LoracError(f"--trained-layers must look like A:B (e.g. 20:30) or i,j,k, got {self.trained_layers!r}") from None
        return range(lo, hi)

    def keeps_quantized(self, dense_bytes=None) -> bool:
        """Whether a quantized base stays in its blocks (--quantized-base, else the device's
        default: KEEPS_QUANTIZED, or where the device has KEEPS_QUANTIZED_ABOVE (the CPU), kept
        only when the base held dense, `dense_bytes()` bytes, would take more than that share
        of the memory free now: dense is the faster step there, docs/BENCHMARKS.md)."""
        if self.quantize or self.quantized_base == "keep":
            return True
        if self.quantized_base == "dequantize":
            return False
        device = devices.for_target(self.target)
        if device.KEEPS_QUANTIZED:
            return True
        share, free = device.KEEPS_QUANTIZED_ABOVE, device.memory_free()
        return bool(share and dense_bytes and free) and dense_bytes() > share * free
