"""The plan of a run: what it computes and where, decided before any weight or data is read.

From the settings (TrainConfig), the model's spec and config, the sizes of the frozen weights
(memory.frozen_sizes; from the files' headers where nothing else needs them), the device (resolved once from
--target: runtime/devices/) and, when resuming, the checkpoint's run (SavedRun), `plan_run`
decides the packing, the model family's own options, the loss chunk, the activation
checkpointing and each worker's step (TrainSpec), and refuses sizes that cannot fit. It
reads no file and compiles nothing; the only thing it asks the machine is the device's free
memory (--checkpointing auto, the memory check). The run (run.py) loads what the plan
needs; `lorac eval`, `generate` and `export --format onnx` take their graphs' plan from
`plan_graphs`.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from .. import devices
from .. import limits
from . import memory
from ..config import TrainConfig
from ..errors import LoracError


@dataclass(frozen=True)
class Plan:
    cfg: TrainConfig  # the settings as resolved (an adapter's, packing, checkpointing): what checkpoints record
    spec: object  # lorac.graphs ModelSpec (or a family's spec)
    train: object  # lorac.graphs TrainSpec: one worker's step
    device: object  # the device module (runtime/devices/)
    workers: int = 1  # data-parallel workers the global --batch is split over

    @property
    def dtype(self) -> str:
        """What the step computes in on the TVM backend (--dtype, else the device's default)."""
        return self.cfg.dtype or self.device.DEFAULT_DTYPE


def resolve_packing(packing: str | None, spec, device) -> str:
    """--packing auto (or None) -> "isolated" where the model family implements it and the
    device runs it at plain packing's cost (ISOLATED_PACKING_FAST: the CPU, and CUDA, where
    each document is a sequence of cuDNN's ragged layout); "plain" for Mamba (its conv and
    scan would need their state reset at document starts: not implemented)."""
    if packing in (None, "auto"):
        from lorac.graphs.families import for_spec
        return "isolated" if for_spec(spec).PACKING_ISOLATED and device.ISOLATED_PACKING_FAST else "plain"
    return packing


def workers_of(cfg: TrainConfig, dp) -> int:
    """Data parallel: each worker's step takes its share of the global --batch (--compile-only
    --gpus N, in one process, compiles that step too)."""
    return dp.size if dp.size > 1 else max(cfg.gpus, 1)


def plan_run(cfg: TrainConfig, spec, model_config: dict, frozen: tuple[int, int], *, quant: tuple = (),
             adapter=None, saved=None, dp=None, log=None) -> Plan:
    """The Plan of `lorac train` (module doc). `frozen`: (dense frozen elements, bytes of
    quantized blocks), train/memory.frozen_sizes; `quant`: the weights held quantized
    (TrainSpec.quant); `adapter`: the --adapter read (its settings replace the flags it
    decides); `saved`: the --resume checkpoint's SavedRun; `dp`: the data-parallel workers
    (dist.current()); `log` hears each choice and why."""
    from lorac.graphs.families import for_spec
    log = log or (lambda msg: None)
    device = devices.for_target(cfg.target)
    workers = workers_of(cfg, dp) if dp is not None else max(cfg.gpus, 1)
    if adapter is not None:
        cfg = replace(cfg, rank=adapter.rank, alpha=adapter.alpha, rslora=adapter.rslora, lora_targets=adapter.targets,
                      trained_layers=adapter.trained_layers(spec.layers))
        cfg.check_bounds()  # the adapter's alpha, as --alpha's
    packing = resolve_packing(cfg.packing, spec, device)
    if packing != cfg.packing:  # checkpoints record what ran
        cfg = replace(cfg, packing=packing)
    why = " (documents attend only within themselves)" if packing == "isolated" else " (rows attend across documents)"
    if packing == "isolated" and not device.ISOLATED_PACKING_FAST:
        why += "; slower than plain packing on this device (docs/DATA.md)"
    log(f"packing: {packing}{why}")
    try:  # the family's own options (Mamba's scan chunk)
        extra = for_spec(spec).train_extra(cfg.target, cfg.scan_chunk)
    except ValueError as e:
        raise LoracError(str(e)) from None
    if "scan_chunk" in extra:
        log(f"mamba scan chunk: {extra['scan_chunk']}" + ("" if cfg.scan_chunk else f" ({cfg.target} default)"))
    loss_chunk = cfg.loss_chunk
    if loss_chunk == 0 and cfg.resume and saved is not None and saved.loss_chunk:  # what --checkpointing auto chose
        loss_chunk = saved.loss_chunk
        cfg = replace(cfg, loss_chunk=loss_chunk)
        log(f"loss chunk: {loss_chunk} tokens (the checkpoint's)")
    if loss_chunk == 0 and device.LOSS_CHUNK_BYTES:  # bound the [tokens, vocab] logits
        from lorac.graphs.ops.loss import auto_chunk
        loss_chunk = auto_chunk(spec.vocab, cfg.batch // workers * cfg.seq, device.LOSS_CHUNK_BYTES)
        if loss_chunk:
            log(f"loss chunk: {loss_chunk} tokens ({cfg.target} default: fp32 logits of a chunk <= "
                f"{device.LOSS_CHUNK_BYTES / 2**30:g} GiB)")
    train = cfg.train_spec(spec, workers=workers, loss_chunk=loss_chunk, extra=extra, quant=quant)
    from ..model.quant import embeddings
    cfg, train = plan_embeddings(cfg, spec, train, saved=saved)
    if cfg.checkpointing == "auto":
        sized = embeddings.frozen_with(spec, frozen, quant, train.quant)
        cfg, train = choose_checkpointing(cfg, spec, train, sized, device, saved=saved, dp=dp, log=log)
    if cfg.quantize_embeddings == "auto":  # checkpoints record what ran
        cfg = replace(cfg, quantize_embeddings="off")
    frozen = embeddings.frozen_with(spec, frozen, quant, train.quant)  # the tables the run quantizes
    if cfg.quantize_embeddings != "off":
        log(f"embeddings: {embeddings.describe(spec, train.quant, cfg.dtype or device.DEFAULT_DTYPE, train.head_slices)}")
    cfg, on_gpu = plan_host_tables(cfg, spec, train, frozen, device, log)
    train.validate(spec)
    # before any compile: an impossible size would only fill memory
    limits.check_context(cfg.seq, model_config, "--seq")
    limits.check_rank(spec, train)
    limits.check_memory(spec, train, on_gpu[0], device, on_gpu[1])
    return Plan(cfg, spec, train, device, workers)


def host_tables_possible(cfg: TrainConfig, spec, device) -> bool:
    """Whether the run may hold the input embedding in host memory (--offload-embeddings): an untied
    table, on a device whose kernels read pinned host memory in place, on the TVM backend."""
    return memory.host_table(spec) is not None and device.host_table is not None and cfg.backend == "tvm"


def plan_host_tables(cfg: TrainConfig, spec, train, frozen: tuple[int, int], device, log):
    """--offload-embeddings resolved (auto: on where the step checkpoints and the table may move;
    choose_checkpointing may have decided it already, to fit its budget) and logged -> (cfg, the
    frozen sizes the device holds: memory.frozen_on_device)."""
    name = memory.host_table(spec)
    if cfg.offload_embeddings == "on" and name is None:
        raise LoracError("--offload-embeddings on: this model's input embedding is also its LM head (tied "
                         "embeddings), which the loss reads whole every step: it stays on the GPU (use off or auto)")
    if cfg.offload_embeddings == "auto":
        on = host_tables_possible(cfg, spec, device) and train.checkpointing
        cfg = replace(cfg, offload_embeddings="on" if on else "off")
    on_gpu = memory.frozen_on_device(spec, frozen, train.quant, cfg.offload_embeddings == "on")
    if on_gpu != frozen:
        itemsize = 2 if (cfg.dtype or device.DEFAULT_DTYPE) == "bfloat16" else 4
        size = (frozen[0] - on_gpu[0]) * itemsize + frozen[1] - on_gpu[1]
        log(f"embeddings: {name} waits in pinned host memory ({size / 1e9:.2f} GB off the GPU); the lookup reads "
            "the rows of each step's tokens over PCIe (--offload-embeddings)")
    return cfg, on_gpu


def plan_embeddings(cfg: TrainConfig, spec, train, *, saved=None):
    """--quantize-embeddings nf4|int8: the model's embedding tables join TrainSpec.quant (the run
    quantizes them once the plan is made: runtime/model/quant/embeddings.py); auto when resuming:
    the checkpoint's choice; otherwise auto stays for the memory choice (choose_checkpointing).
    Returns (cfg, train)."""
    from ..model.quant import embeddings
    if cfg.quantize_embeddings == "auto" and cfg.resume and saved is not None:
        cfg = replace(cfg, quantize_embeddings=saved.quantize_embeddings or "off")
    if cfg.quantize_embeddings in embeddings.KINDS:
        train = embeddings.held(spec, train, cfg.quantize_embeddings)
    return cfg, train


def choose_checkpointing(cfg: TrainConfig, spec, train, frozen: tuple[int, int], device, *, saved=None, dp=None,
                         log=None):
    """Resolve --checkpointing auto (runtime/train/memory.py) into on/off and --keep-layers,
    in the settings too (checkpoints record what ran; a resumed run compiles the same graph).
    Returns (cfg, train)."""
    from . import memory as step_memory
    off, state_off, mlp = False, False, cfg.keep_mlp
    if cfg.resume:  # the checkpoint's graph
        ckpt, keep, off = saved.checkpointing in ("on", "offload"), saved.keep_layers, saved.checkpointing == "offload"
        mlp = saved.keep_mlp if off else 0
        state_off = cfg.offload_state == "auto" and saved.offload_state == "off"
        why = f"the checkpoint's setting ({cfg.resume})"
    elif cfg.keep_layers:
        ckpt, keep, why = True, cfg.keep_layers, "--keep-layers given"
    elif not device.AUTO_CHECKPOINTING or cfg.backend != "tvm":
        ckpt, keep, why = False, 0, f"auto is off on --target {cfg.target}" if cfg.backend == "tvm" else \
            "auto is off on --backend ort"
    else:
        free = None if cfg.memory_budget is not None else device.memory_free()
        budget, source = step_memory.budget_from(free, cfg.memory_budget)
        gather = getattr(dp, "gather", None)
        if gather is not None and budget is not None:  # every worker compiles the same step
            budget = int(gather([budget], "the memory budgets").min())
            source += f", the least of {dp.size} workers"
        dtype = cfg.dtype or device.DEFAULT_DTYPE
        on_host = cfg.offload_embeddings == "on" and host_tables_possible(cfg, spec, device)

        # --loss-chunk not given: smaller chunks than the device's default may keep more layers
        chunks = step_memory.loss_chunks(train.loss_chunk, train.batch * train.seq) if cfg.loss_chunk == 0 else None

        def fit(train, on_host: bool, sized=frozen):  # the choice for `train` over these frozen sizes
            n_weights, packed = step_memory.frozen_on_device(spec, sized, train.quant, on_host)
            return step_memory.choose(spec, train, n_weights, dtype, budget, source, packed,
                                      offload=device.OFFLOADS, host=device.host_pinnable(), chunks=chunks)
        choice = fit(train, on_host)
        if choice.checkpointing and cfg.offload_embeddings == "auto" and host_tables_possible(cfg, spec, device):
            # memory binds: the input embedding moves to host memory, and the setting is chosen again
            choice, on_host, cfg = fit(train, True), True, replace(cfg, offload_embeddings="on")
        if choice.need is not None and choice.need > budget and cfg.quantize_embeddings == "auto" and train.quant:
            # a QLoRA run (the loaded base keeps quantized layers) that no setting fits with dense tables
            cfg, train, choice = _embeddings_to_fit(cfg, spec, train, frozen, choice, budget, fit, on_host, log)
        ckpt, keep, off, why = choice.checkpointing, choice.keep_layers, choice.offload, choice.why
        state_off, mlp = choice.state_off, choice.keep_mlp
        if choice.loss_chunk is not None:  # recorded, so a resumed run compiles the same step
            if log is not None:
                log(f"loss chunk: {choice.loss_chunk} tokens (--checkpointing auto: the default {train.loss_chunk}'s "
                    "logits leave no room for the setting below)")
            train, cfg = replace(train, loss_chunk=choice.loss_chunk), replace(cfg, loss_chunk=choice.loss_chunk)
        if choice.need is not None and choice.need > budget and device.KEEPS_QUANTIZED and not train.quant:
            why += "; " + limits.QUANTIZE_HINT
    off = off and ckpt
    mlp = mlp if off and not state_off else 0
    train = replace(train, checkpointing=ckpt, keep_layers=keep if ckpt else 0, offload=off, keep_mlp=mlp)
    cfg = replace(cfg, checkpointing="offload" if off else "on" if ckpt else "off", keep_layers=keep if ckpt else 0,
                  keep_mlp=mlp)
    if off and state_off:  # the offloaded attention state did not fit: the inputs alone (recorded for --resume)
        train, cfg = replace(train, offload_state=False), replace(cfg, offload_state="off")
    if log is not None:
        from lorac.graphs.compose import offloads_state
        host = step_memory.offload_host(spec, train, cfg.dtype or device.DEFAULT_DTYPE)
        setting = step_memory.describe(ckpt, keep, len(train.layers(spec)), off, offloads_state(spec, train), host, mlp)
        log(f"memory: auto: {setting} ({why})")
    return cfg, train


def _embeddings_to_fit(cfg: TrainConfig, spec, train, frozen, dense, budget, fit, on_host: bool, log):
    """--quantize-embeddings auto where no setting fits the budget with dense embeddings: the same
    choice (choose_checkpointing's `fit`) with them in NF4 (a plain absmax) -> (cfg, train, choice);
    dense still, when the hidden size has no whole NF4 blocks."""
    from ..errors import LoracError
    from ..model.quant import embeddings
    try:
        held = embeddings.held(spec, train, "nf4")
    except LoracError as e:
        if log is not None:
            log(f"embeddings: auto: dense ({e})")
        return cfg, train, dense
    choice = fit(held, on_host, embeddings.frozen_with(spec, frozen, train.quant, held.quant))
    if log is not None:
        log(f"embeddings: auto: nf4 (with dense embeddings even full checkpointing needs an estimated "
            f"{dense.need / 1e9:.1f} GB, more than the {budget / 1e9:.1f} GB budget; NF4 embeddings: "
            f"{choice.need / 1e9:.1f} GB)")
    return replace(cfg, quantize_embeddings="nf4"), held, choice


def plan_graphs(cfg: TrainConfig, spec) -> Plan:
    """The Plan of the graphs `lorac eval`, `generate` and `export --format onnx` build from
    settings (a checkpoint's, SavedRun.config): the settings' step with the packing resolved
    for --target's device, no recomputation and one loss chunk (nothing to fit: no backward
    runs, or the graph is exported), and no family options."""
    device = devices.for_target(cfg.target)
    cfg = replace(cfg, packing=resolve_packing(cfg.packing, spec, device), checkpointing="off", keep_layers=0)
    # (a quantized base's layout is the loaded weights': eval and generate hold theirs dense)
    return Plan(cfg, spec, cfg.train_spec(spec, loss_chunk=0), device)
