"""The device memory a training step will hold, known before anything is compiled, and the
fastest activation-checkpointing setting that fits a budget (`--checkpointing auto`).

The estimate is the compiler's static plan for the step (activations and workspace) plus
the frozen weights and the LoRA state (parameters, gradients, AdamW moments: 16 bytes a
parameter), the three numbers `engine.memory_summary` reports from a built artifact. It has
to be known without the compiler (a GPU machine that only runs carried artifacts chooses
too), so the plan is modelled, per token of the step (T = batch x seq), from what the
compiled CUDA steps were measured to plan:

- each trained layer keeps, for its backward, by setting:
  - no checkpointing, everything its backward reads ("full"); for the Llama/Qwen/Mistral
    decoder in bf16: its input, q, k, v, the attention output, the mid-layer residual, gate
    and up (`lean`, 2D + 2q + 2kv + 2I values; Qwen3 adds q and k before their norm) plus
    the two norms' outputs and silu(gate) * up (2D + I);
  - checkpointing, a kept layer (--keep-layers) only what costs a GEMM or attention to
    recompute (`lean`, graphs/decoder.py Saved);
  - checkpointing, a recomputed layer only its input (D values, a tenth more for the
    per-token statistics beside it);
- frozen layers below the first trained one keep nothing;
- the peak is the larger of two moments: the loss, with every layer's kept set, one loss
  chunk's logits [chunk, V] and their gradient (one vocabulary slice wide where the head is
  quantized: `loss_bytes`) and a few [T, D] values (residual, its gradient: 3 x
  itemsize x D bytes a token); and a layer's backward (the layers below it, its full set,
  recomputed or not, and its gradients: 3 [T, D] values; Mamba's scan 8 [T, I]), which is
  the larger with checkpointing and a small vocabulary.
Phi-3 keeps its fused projections' outputs as well; Mamba keeps ~18 I values a token in a
layer, its recomputed layers an fp32 input. Each family states its widths (`activation_bytes`
in graphs/families/; the decoder's in graphs/decoder.py). Measured against the plans of
compiled bf16 CUDA steps (bench/step_memory_fit.py, tests/test_step_memory.py; Llama-3-8B
shape 4x2048 keeping 27 of 32 layers: 21.9 estimated, 22.13 GB planned; Qwen3-0.6B 8x1024:
11.6 vs 11.7 GB) the estimates of the Llama, Qwen3 and Mamba shapes are within 4 %,
Phi-3's within 3-13 % (both sides), and the small shapes of the tests up to 7 % over.
Attention that is not cuDNN's fused unit (fp32 steps, windows shorter than the sequence,
Gemma 2's soft-capped scores) holds score matrices this model leaves out: there the
estimate is None and `auto` does not checkpoint. Documents packed in isolation run on the
fused unit too (cuDNN's ragged layout) and keep what plain rows keep.
"""
from __future__ import annotations

import math

from dataclasses import dataclass, replace

from lorac.core import constants
from lorac.core.constants import LORA_K_WIDE, packed_bias_bytes, packed_kernels_take

GiB = 1 << 30
WORKSPACE = 1 * GiB  # cuBLAS/cuDNN workspaces and the runtime beside the plan (0.8 GB at the 8B shape)


@dataclass(frozen=True)
class Choice:
    checkpointing: bool
    keep_layers: int
    need: int | None  # estimated bytes, None when not estimated
    why: str  # one line for the log
    offload: bool = False  # the recomputed layers' inputs wait in host memory
    state_off: bool = False  # ... without their attention state, which `auto` would send (it did not fit)
    keep_mlp: int = 0  # recomputed layers that keep their MLP's gate and up (TrainSpec.keep_mlp)
    loss_chunk: int | None = None  # the loss chunk it fits with, where smaller than the run's (None: the run's)


def describe(checkpointing: bool, keep_layers: int, n_trained: int, offload: bool = False, state: bool = False,
             host_bytes: int = 0, keep_mlp: int = 0) -> str:
    """The log's words for a setting; `state`: the offloaded layers send their attention state too;
    `host_bytes`: the pinned host memory they take (offload_host); `keep_mlp`: TrainSpec.keep_mlp."""
    if not checkpointing:
        return "checkpointing off"
    what = "inputs and attention state" if state else "inputs"
    pinned = f" ({host_bytes / 1e9:.1f} GB pinned)" if host_bytes else ""
    where = f", their {what} offloaded to host memory{pinned}" if offload and keep_layers < n_trained else ""
    if keep_mlp and where:
        mlp = min(keep_mlp, n_trained - min(keep_layers, n_trained))
        where += f"; {mlp} of those {'keeps its' if mlp == 1 else 'keep their'} MLP's gate and up on the GPU " \
                 "(no recompute)"
    if keep_layers:
        return f"checkpointing on, keeping {min(keep_layers, n_trained)} of {n_trained} layers{where}"
    return f"checkpointing on, all {n_trained} layers recomputed{where}"


def _fused_attention(spec, train, dtype: str) -> bool:
    """Whether the step's attention is cuDNN's fused unit as far as the run's settings go (no
    [S, S] scores kept); a family whose attention never is says so itself (activation_bytes)."""
    if dtype != "bfloat16":
        return False
    window = getattr(spec, "sliding_window", None)
    return window is None or window >= train.seq


def plan_bytes(spec, train, dtype: str = "bfloat16") -> int | None:
    """The step's static plan (activations and workspace; the module doc), or None where the
    model does not apply."""
    from lorac.graphs.families import for_spec
    itemsize = 2 if dtype == "bfloat16" else 4
    per = for_spec(spec).activation_bytes(spec, itemsize)
    if per is None or (hasattr(spec, "heads") and not _fused_attention(spec, train, dtype)):
        return None
    full, lean, recomputed, backward = per
    T = train.batch * train.seq
    if getattr(train, "offload", False):  # a recomputed layer's input waits in host memory (graphs/ops/offload.py)
        recomputed = max(recomputed - itemsize * spec.hidden, 0)
    again, mlp_layers = set(train.recomputed_layers(spec)), set(train.mlp_kept_layers(spec))  # once a plan
    mlp = for_spec(spec).mlp_state_bytes(spec, itemsize) if mlp_layers else 0
    kept = [full if not train.checkpointing else lean if layer not in again else
            recomputed + (mlp if layer in mlp_layers else 0) for layer in train.layers(spec)]
    chunk = min(train.loss_chunk or T, T)
    peak = (sum(kept) + 3 * itemsize * spec.hidden) * T + loss_bytes(spec, train, chunk)  # the loss, everything kept
    below = 0.0
    for k in kept:  # each layer's backward, bottom up: the layers below it, its full set again, gradients
        peak = max(peak, (below + full + backward) * T)
        below += k
    isolated = getattr(train, "packing", "plain") == "isolated" and dtype == "bfloat16"
    if isolated and not packed_kernels_take(train.seq, spec.head_dim):
        peak += packed_bias_bytes(train.batch, train.seq)  # cuDNN's documents' bias, live all step
    return int(peak)


def loss_bytes(spec, train, chunk: int) -> int:
    """One loss chunk's logits and their gradient ([chunk, V] each, bf16 from the GEMMs: 4 bytes a
    logit measured); with a quantized head, read in vocabulary slices (graphs/ops/loss.py), the
    gradient is one slice wide: at Llama-3-8B's 1x2048, 0.57 instead of 1.05 GB (its compiled
    2-layer plan held 525 MB of logits and a 48 MB slice gradient at the loss)."""
    from lorac.graphs.ops.loss import head_slices
    if not head_quantized(spec, train):
        return 4 * chunk * spec.vocab
    rows = max(hi - lo for lo, hi in head_slices(spec.vocab, spec.hidden, train.head_slices))
    return 2 * chunk * (spec.vocab + rows)


def head_quantized(spec, train) -> bool:
    """Whether the LM head is held quantized (--quantize-embeddings): each loss chunk dequantizes it."""
    from lorac.graphs.families import for_spec
    tables = for_spec(spec).EMBEDDINGS
    return (tables[0] if spec.tied else tables[1]) in dict(train.quant)


def frozen_sizes(weights: dict) -> tuple[int, int]:
    """(elements of the dense frozen weights and biases, which the device holds in the compute
    dtype; bytes of everything else: quantized blocks and their scales (graphs/ops/quant.py), which
    keep their own dtype on every device)."""
    dense = packed = 0
    for name, w in weights.items():
        if name.endswith((".weight", ".bias")) and w.dtype.kind == "f":
            dense += int(w.size)
        else:
            packed += int(w.nbytes)
    return dense, packed


def host_table(spec) -> str | None:
    """The HF name of the table --offload-embeddings may hold in host memory: an untied model's input
    embedding, which only the lookup of the step's tokens reads (a tied one is the LM head too)."""
    from lorac.graphs.families import for_spec
    return None if spec.tied else for_spec(spec).EMBEDDINGS[0]


def frozen_on_device(spec, frozen: tuple[int, int], quant: tuple, on_host: bool) -> tuple[int, int]:
    """frozen_sizes' (dense elements, packed bytes) less the input table where it waits in host
    memory (`on_host`): its dense elements, or its blocks and scales where `quant` holds it quantized."""
    name = host_table(spec)
    if not on_host or name is None:
        return frozen
    held = dict(quant)
    if name in held:
        from ..model.quant.embeddings import table_bytes
        return frozen[0], frozen[1] - table_bytes(spec, ((name, held[name]),))
    return frozen[0] - spec.vocab * spec.hidden, frozen[1]


def dequant_workspace(spec, train, dtype: str) -> int:
    """Bytes of the dense copies quantized weights are dequantized into: each lives from its
    dequantization to the GEMM that reads it; two of the largest at once (the next layer's
    may be formed while the last is read). A quantized LM head is read in vocabulary slices
    (graphs/ops/loss.py head_slices): a slice counts as a projection does. A quantized
    embedding's lookup dequantizes only the rows it reads ([T, D], at the step's start, far from
    its peak: not counted)."""
    from lorac.graphs.families import for_spec
    from lorac.graphs.ops.loss import head_slices
    if not train.quant:
        return 0
    itemsize = 2 if dtype == "bfloat16" else 4
    tables = for_spec(spec).EMBEDDINGS
    head = tables[0] if spec.tied else tables[1]
    quant = {name.split(".")[-2] for name, _ in train.quant if name not in tables}
    # projections joined with their LoRA terms into one GEMM over [x | u...] and [W | B | 0...]
    # (compiler/passes/gemm_lora_k.py): their rows a rank wider per projection of their join, and
    # the step's [T, in + ranks] copy of x beside them
    groups = joined_groups(spec, train, quant) if dtype == "bfloat16" else []
    extra = {t: len(group) * train.rank for group in groups for t in group}
    sizes = [spec.proj_shape(t)[0] * (spec.proj_shape(t)[1] + extra.get(t, 0)) for t in quant]
    joined = max((train.batch * train.seq * (spec.proj_shape(group[0])[1] + extra[group[0]]) for group in groups),
                 default=0)
    if head in dict(train.quant):
        sizes.append(max(hi - lo for lo, hi in head_slices(spec.vocab, spec.hidden, train.head_slices)) * spec.hidden)
    return (2 * max(sizes, default=0) + joined) * itemsize


def joined_groups(spec, train, among) -> list[tuple[str, ...]]:
    """The adapted projections of `among` (target names) that compiler/passes/gemm_lora_k.py joins with
    their LoRA terms, by the join they share: those of one input at least LORA_K_WIDE times as wide as
    it (gate/up; Phi-3's fused gate_up alone), or with LORA_K_GROUPS two or more of one input whose
    outputs together are at least as wide as it (q/k/v too). Their ranks must be multiples of 4 (the
    join's vectors)."""
    from lorac.graphs.decoder import GATE_UP, QKV  # the projections that read one input
    shape = getattr(spec, "proj_shape", None)
    if shape is None or train.rank % 4:
        return []
    adapted = [t for t in train.lora_targets if t in among]
    wide = lambda t: shape(t)[0] >= LORA_K_WIDE * shape(t)[1]  # noqa: E731
    groups = []
    for group in (QKV, GATE_UP):
        members = tuple(t for t in group if t in adapted)
        joined = sum(shape(t)[0] for t in members) >= shape(group[0])[1] if members else False
        if not (constants.LORA_K_GROUPS and len(members) > 1 and joined):
            members = tuple(t for t in members if wide(t))
        if members:
            groups.append(members)
    grouped = {t for grp in groups for t in grp}
    return groups + [(t,) for t in adapted if t not in grouped and wide(t)]


def joined_dense(spec, train, dtype: str) -> int:
    """Bytes a bf16 base's projections held joined with their LoRA B columns add (compiler/passes/
    gemm_lora_k.py): each joined projection's rows a rank wider per projection of its join, in every
    layer, and the step's [T, in + ranks] copy of x beside them (the widest join's)."""
    if dtype != "bfloat16":
        return 0
    quant = {name.split(".")[-2] for name, _ in train.quant}
    groups = joined_groups(spec, train, set(train.lora_targets) - quant)
    if not groups:
        return 0
    rows = sum(spec.proj_shape(t)[0] * len(grp) * train.rank for grp in groups for t in grp) * spec.layers
    x = max(train.batch * train.seq * (spec.proj_shape(grp[0])[1] + len(grp) * train.rank) for grp in groups)
    return 2 * (rows + x)


def estimate(spec, train, n_weights: int, dtype: str = "bfloat16", packed_bytes: int = 0) -> int | None:
    """Bytes the step holds on a CUDA device: static plan + frozen weights (`n_weights` dense
    elements, `packed_bytes` of quantized blocks: frozen_sizes) + LoRA state (parameters,
    gradients, AdamW moments in fp32), or None where the plan is not modelled."""
    from ..limits import lora_params
    plan = plan_bytes(spec, train, dtype)
    if plan is None:
        return None
    weights = n_weights * (2 if dtype == "bfloat16" else 4) + packed_bytes
    return plan + dequant_workspace(spec, train, dtype) + joined_dense(spec, train, dtype) + \
        offload_staging(spec, train, dtype) + weights + 16 * lora_params(spec, train)


def _slot_token_bytes(spec, train, dtype: str) -> int:
    """Bytes a token of one offloaded layer's slot: its input, or with the attention state its values."""
    from lorac.graphs.compose import family, offloads_state
    itemsize = 2 if dtype == "bfloat16" else 4
    return family(spec).offload_state_bytes(spec, itemsize) if offloads_state(spec, train) else itemsize * spec.hidden


def offload_host(spec, train, dtype: str) -> int:
    """Pinned host memory the offloaded layers' slots take: one slot a recomputed layer but the top
    one, whose values wait in device staging (runtime/devices/cuda/offload.py)."""
    if not (getattr(train, "offload", False) and train.checkpointing):
        return 0
    recomputed = max(len(train.layers(spec)) - train.keep_layers, 0)
    return max(recomputed - 1, 0) * train.batch * train.seq * _slot_token_bytes(spec, train, dtype)


def offload_staging(spec, train, dtype: str) -> int:
    """The device memory offloaded values pass through: two staging buffers of a layer's slot (its
    input or with the attention state its TrainSpec.offload_state values), and the slot fetched one
    call ahead, which the plan holds beside the layer being recomputed (runtime/devices/cuda/offload.py)."""
    if not getattr(train, "offload", False):
        return 0
    return 3 * train.batch * train.seq * _slot_token_bytes(spec, train, dtype)


def settings(n_trained: int, offload: bool = False):
    """(checkpointing, keep_layers, offload) from fastest to leanest: no checkpointing, then
    every layer kept lean, then one layer fewer kept at a time down to all recomputed; where
    the device offloads, each count of kept layers with its recomputed layers' inputs in host
    memory too, right after it (the copies overlap the compute: about the same time, less memory)."""
    yield False, 0, False
    for keep in range(n_trained, -1, -1):
        yield True, keep, False
        if offload and keep < n_trained:
            yield True, keep, True


MIN_LOSS_CHUNK = 512  # the smallest loss chunk `auto` takes to keep more layers


def loss_chunks(chunk: int, tokens: int) -> tuple[int, ...]:
    """The loss chunks `auto` may try where --loss-chunk was not given, fastest first: the device's
    default (0: one chunk), then powers of two below it (below all the tokens) down to MIN_LOSS_CHUNK.
    A smaller chunk only shrinks the [chunk, V] logits at the loss (0.5 GB a halving at Llama-3-8B's
    vocabulary from 2048 tokens) and the head's GEMMs stay large; a layer recomputed costs its
    forward again (~7 ms at Llama-3-8B 4x2048 on an H100), so each setting is tried with every
    chunk before the next, leaner one (choose; not where the head is quantized: each chunk
    dequantizes it)."""
    out, c = [chunk], 1 << max((chunk or tokens) - 1, 1).bit_length() - 1
    while c >= MIN_LOSS_CHUNK:
        out.append(c)
        c //= 2
    return tuple(out)


def budget_from(free: int | None, asked_gb: float | None) -> tuple[int | None, str]:
    """The bytes a step may plan for, and where the number comes from: --memory-budget less
    the library workspaces, else the GPU's free memory less max(2 GiB, 5 %) (workspaces,
    fragmentation, other processes' growth)."""
    if asked_gb is not None:
        return int(asked_gb * 1e9) - WORKSPACE, f"--memory-budget {asked_gb:g} GB less {WORKSPACE / GiB:g} GiB of workspaces"
    if free is None:
        return None, "no GPU visible"
    reserve = max(2 * GiB, free // 20)
    return free - reserve, f"{free / 1e9:.1f} GB free on the GPU less {reserve / 1e9:.1f} GB reserve"


def choose(spec, train, n_weights: int, dtype: str, budget: int | None, source: str, packed_bytes: int = 0,
           offload: bool = False, host: int | None = None, chunks: tuple[int, ...] | None = None) -> Choice:
    """The fastest of settings() whose estimate fits `budget` (the leanest when none
    does); no checkpointing without a budget or an estimate. offload: the device can offload;
    host: bytes of host memory the offloaded values may pin (None: no limit): a setting that
    would pin more is passed over. Where --offload-state auto sends the attention state with the
    offloaded inputs and even every layer recomputed does not fit, the offloaded settings are
    tried again with the inputs alone (their staging is a few times smaller; the steps slower).
    chunks: the loss chunks the run may use (loss_chunks; default: the run's own), each setting tried
    with each before the next setting: the Choice says the chunk where it is not the first."""
    from lorac.graphs.compose import family, offloads_state
    gb = lambda n: f"{n / 1e9:.1f} GB"
    if budget is None:
        return Choice(False, 0, None, f"{source}, no budget to fit; give --memory-budget GB to choose for a GPU")
    n_trained = len(train.layers(spec))
    first, passed, leanest = None, "", None
    state = offload and offloads_state(spec, replace(train, offload=True))
    mlp = state and hasattr(family(spec), "mlp_state")
    candidates = []
    for c, k, o in settings(n_trained, offload):
        candidates.append((c, k, o, False, 0))
        if o and mlp:  # as many layers without a recompute, m of them keeping only their MLP half: leaner
            candidates += [(True, k - m, True, False, m) for m in range(1, k + 1)]
    if state and train.offload_state is None:
        candidates += [(True, keep, True, True, 0) for keep in range(n_trained - 1, -1, -1)]
    chunks = chunks or (train.loss_chunk,)
    if head_quantized(spec, train):  # each chunk dequantizes the head again: a smaller one costs more than a layer
        chunks = chunks[:1]
    candidates = [(*c, chunk) for c in candidates for chunk in chunks]
    for ckpt, keep, off, state_off, keep_mlp, chunk in candidates:
        setting = replace(train, checkpointing=ckpt, keep_layers=keep, offload=off, loss_chunk=chunk,
                          keep_mlp=keep_mlp)
        if state_off:
            setting = replace(setting, offload_state=False)
        if off and host is not None and offload_host(spec, setting, dtype) > host:
            passed = f"; offload passed over: it would pin more than the host's {gb(host)}"
            continue
        need = estimate(spec, setting, n_weights, dtype, packed_bytes)
        if need is None:
            return Choice(False, 0, None, "no memory estimate for this model and attention (docs/RUNTIME.md); "
                                          "set --checkpointing / --keep-layers yourself")
        first = first or need
        if leanest is None or need <= leanest[0]:  # on a tie the later, leaner one
            leanest = (need, ckpt, keep, off, state_off, keep_mlp, chunk)
        if need <= budget:
            more = "" if not ckpt else f"; no checkpointing needs {gb(first)}{passed}"
            if chunk != chunks[0]:
                more += f"; {chunk}-token loss chunks, smaller than the default's logits, to fit it"
            if state_off:
                lean = estimate(spec, replace(train, checkpointing=True, keep_layers=0, offload=True), n_weights,
                                dtype, packed_bytes)
                more += f"; with their attention state offloaded too every layer recomputed needs {gb(lean)}"
            return Choice(ckpt, keep, need, f"estimated {gb(need)} of a {gb(budget)} budget ({source}){more}", off,
                          state_off, keep_mlp, None if chunk == chunks[0] else chunk)
    need, _, keep, off, state_off, keep_mlp, chunk = leanest  # the leanest setting estimated (an offloaded one the host can pin)
    return Choice(True, keep, need, f"even full checkpointing needs an estimated {gb(need)}, more than the "
                                    f"{gb(budget)} budget ({source}){passed}; trying it anyway", off, state_off,
                  keep_mlp, None if chunk == chunks[0] else chunk)
