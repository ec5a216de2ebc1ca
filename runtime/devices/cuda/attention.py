"""cuDNN fused attention (SDPA, flash-style) for CUDA artifacts, without torch.

The compiler maps the graph's attention units to DPS calls (compiler/targets/cuda/attention.py):

    lorac.attention_fwd(q, k, v, o, lse)
    lorac.attention_bwd(q, k, v, o, do, lse, dq, dk, dv)
    lorac.attention_packed_fwd(q, k, v, x, o, lse)                 --packing isolated
    lorac.attention_packed_bwd(q, k, v, o, do, lse, x, dq, dk, dv)

q, o, do, dq: bf16 [B, S, H, Dh]; k, v, dk, dv: bf16 [B, S, K, Dh] (token-major, read by
cuDNN through strides; K < H is grouped-query attention, native in cuDNN); lse: fp32, the
log-sum-exp of each causal softmax row (cuDNN's "stats"). The softmax scale of each call
shape comes from the manifest (`unit_calls`), and for packed calls how the build masks the
documents (`mask`, runtime/devices/cuda/sdpa.py has the graphs):

- "ragged" (x: the position ids [B, S], not read): each document a sequence of cuDNN's
  ragged (THD) layout, given by its length and the offset of its first token
  (runtime/devices/cuda/documents.py); lse token-major [B, S, H, 1]. Those lengths and
  offsets live in device buffers per [B, S] shape, filled from the batch's position_ids
  before each call of the artifact (`feeder`, which the artifact's Step calls), so a captured
  CUDA graph replays with each batch's documents. The plans' sequences and their longest
  length come from the run's data (`reserve_documents`); PACKED["bounds"] splits documents
  by length into groups with plans of their own.
- "bias" (x: bf16 [B, 1, S, S], 0 inside each query's document and -1e30 before it, computed
  by the step from the position ids): plain rows with that additive bias; lse [B, H, S, 1].
  Nothing is fed from the host.
- "kernel" (x: the position ids [B, S], read on the device): not cuDNN but lorac's own kernels,
  compiled into the artifact (runtime/devices/cuda/packed.py); lse token-major as for ragged.

cuDNN comes from NVIDIA's pip wheels (nvidia-cudnn-frontend's Python graph API over
nvidia-cudnn-cu13's libcudnn). Plans are built when the artifact loads, from the calls the
manifest lists, and each is executed once on scratch buffers then: the first step of a
CUDA-graph artifact is captured, and building plans, loading kernels or allocating inside a
capture is not allowed. Calls run on the stream TVM names (the capture stream while a graph
records), like the cuBLAS GEMMs (runtime/devices/cuda/cublas.py). At exit release() frees
the plans and the handle before Python's teardown, so a run ends on its summary rather than
on cuDNN frontend's leak report.
"""
from __future__ import annotations

import numpy as np

from ...errors import LoracError
from .cudart import load_library, stream_getter
from .documents import Documents, document_runs, groups_for
from .packed import PackedKernels, find_entry, shape_of
from .sdpa import Plan

FWD, BWD = "lorac.attention_fwd", "lorac.attention_bwd"
PACKED_FWD, PACKED_BWD = "lorac.attention_packed_fwd", "lorac.attention_packed_bwd"
FUNCTIONS = (FWD, BWD, PACKED_FWD, PACKED_BWD)
_PACKED = (PACKED_FWD, PACKED_BWD)
MASKS = ("ragged", "bias", "kernel")  # how a build masks packed documents (the manifest call's "mask")

# How the packed calls' plans are built, chosen from bench/cudnn_isolated_check.py's measurements
# on the H200 (docs/BENCHMARKS.md, "Isolated packing", its cuDNN part); set before artifacts load. The
# defaults are what that check verified there first; the others await its speed stage.
#   max_seq        "row": ragged plans hold sequences of up to S tokens; "longest": of at most
#                  the longest document the run's data has (reserve_documents), rounded up to 64
#   bounds         document lengths splitting the ragged sequences into groups (documents.py)
#   deterministic  the backward's use_deterministic_algorithm
#   implementation the forward's cuDNN implementation (None: AUTO; "COMPOSITE", "UNIFIED")
#   engine         {"fwd": name, "bwd": name}: the cuDNN plans to build (None: the heuristics' first)
#   band           bias plans cut the causal band one key past the longest document the run's data
#                  has (reserve_documents; none when unknown): cuDNN computes no tile further back,
#                  which no query's document reaches (rows of short documents: ~1.2x the plain
#                  call instead of ~1.5x); False: the whole causal triangle
PACKED = {"max_seq": "row", "bounds": (), "deterministic": False, "implementation": None, "engine": None,
          "band": True}

_cudnn = None  # the module, imported on first use
_handle = None
_stream = [None]
_plans: dict = {}  # (function, B, S, H, K, Dh, mask) -> [Plan] (ragged: one a group; the scale from the manifest)
_documents: dict = {}  # (B, S) -> Documents: what the ragged calls of that shape read
_kernels: dict = {}  # (function, B, S, H, K, Dh) -> (PackedKernels, scale): calls of mask "kernel"
_kernel_sets: dict = {}  # (H, K, Dh, S, pos dtype) -> PackedKernels: a manifest's packed_kernels entry, loaded
_reserved = {"per_row": None, "longest": None}  # reserve_documents (None: every token a document, S)
_workspace = {"bytes": 0, "tensor": None, "ptr": 0}


def _init() -> None:
    global _cudnn, _handle
    if _handle is not None:
        return
    for name in ("libcudart", "libcublasLt", "libnvrtc"):  # cuDNN's engines load these by soname
        try:
            load_library(name)
        except LoracError:
            pass
    try:
        import cudnn
    except (ImportError, OSError) as e:
        raise LoracError("this CUDA artifact runs attention on cuDNN: install nvidia-cudnn-frontend and "
                         f"nvidia-cudnn-cu13 (pip install 'lorac[cuda]') ({e})") from None
    _cudnn = cudnn
    _handle = cudnn.create_handle()
    import atexit
    atexit.register(release)  # after cudnn's own exit hooks are registered, so it runs before them


def release() -> None:
    """Free the plans, the workspace and the handle, in that order, while the interpreter and
    the CUDA context are whole. Run at exit: otherwise the built graphs outlive Python's
    teardown and cuDNN's frontend (nanobind) prints hundreds of `nanobind: leaked ...` lines
    after the run's summary. A later prepare() starts afresh."""
    global _cudnn, _handle
    import gc
    _plans.clear()
    _documents.clear()
    _kernels.clear()
    _kernel_sets.clear()
    _workspace.update(bytes=0, tensor=None, ptr=0)
    gc.collect()  # graphs in reference cycles go now, not in the teardown
    if _handle is not None:
        try:
            _cudnn.destroy_handle(_handle)
        except Exception:  # noqa: BLE001 - at exit nothing is left to report it to
            pass
    _cudnn, _handle, _stream[0] = None, None, None


def reserve_documents(per_row: int, longest: int | None = None) -> None:
    """The most documents one row of the run's data holds (--packing isolated) and its longest
    document (None: a row's length): the ragged plans of shapes prepared from now on hold that
    many sequences a row, of at most that many tokens (PACKED["max_seq"])."""
    _reserved.update(per_row=max(int(per_row), 1), longest=max(int(longest), 1) if longest else None)


def _mask(call: dict) -> str | None:
    if call["function"] not in _PACKED:
        return None
    mask = call.get("mask", "ragged")
    if mask not in MASKS:
        raise LoracError(f"this artifact's packed attention masks documents by {mask!r}; this runtime knows "
                         f"{', '.join(MASKS)} (a newer lorac compiled it?)")
    return mask


def _key(call: dict) -> tuple:
    return (call["function"], call["B"], call["S"], call["H"], call["K"], call["Dh"], _mask(call))


def _set_stream(device_index: int) -> None:
    stream = stream_getter()(2, device_index)  # kDLCUDA: the stream TVM launches on
    if stream != _stream[0]:
        _cudnn.set_stream(_handle, stream or 0)
        _stream[0] = stream


def documents_for(B: int, S: int, empty) -> Documents:
    """The lengths and offsets buffers of packed [B, S] rows, made on first use (`empty`: the
    device allocator), in the groups PACKED and the reserved documents give."""
    docs = _documents.get((B, S))
    if docs is None:
        longest = _reserved["longest"] if PACKED["max_seq"] == "longest" else None
        groups = groups_for(B, S, _reserved["per_row"], longest, PACKED["bounds"])
        docs = _documents[(B, S)] = Documents(B, S, groups, empty)
    return docs


def band(S: int, longest: int | None = None) -> int | None:
    """The left bound of bias plans' causal band for rows of S tokens: one key past the longest
    document (`longest`, else the reserved one: a query's document starts at most longest - 1
    keys back), None where that is the whole row or nothing was reserved."""
    longest = _reserved["longest"] if longest is None else longest
    return longest + 1 if longest and longest + 1 < S else None


def build_plan(call: dict, empty) -> tuple[list, bool]:
    """(the plans of a manifest's call, whether they were built now). Bias plans built for
    shorter documents than those reserved since are built again (the band must reach them)."""
    key = _key(call)
    fn, B, S, H, K, Dh, mask = key
    want = band(S) if mask == "bias" and PACKED["band"] else None
    plans = _plans.get(key)
    if plans is not None and plans[0].scale != float(call["scale"]):
        raise LoracError(f"two loaded artifacts make attention calls {key} with different softmax scales")
    if plans is not None and (plans[0].options.get("band") or S) >= (want or S):
        return plans, False
    packed = mask is not None
    docs = documents_for(B, S, empty) if mask == "ragged" else None
    opts = {k: PACKED[k] for k in ("deterministic", "implementation")} if packed else {}
    if packed and PACKED["engine"]:
        opts["engine"] = PACKED["engine"].get("bwd" if fn == PACKED_BWD else "fwd")
    if want:
        opts["band"] = want
    layout = mask or "causal"
    try:
        _plans[key] = [Plan(_cudnn, _handle, fn in (BWD, PACKED_BWD), B, S, H, K, Dh, float(call["scale"]), layout,
                            docs, g, opts) for g in range(len(docs.groups) if docs else 1)]
    except Exception as e:  # cuDNN raises its own error types
        what = f" packed in {docs.capacity} sequences of at most {docs.longest} tokens" if docs else \
            (f" packed, documents masked by a bias{f' (causal band {want})' if want else ''}" if packed else "")
        raise LoracError(f"cuDNN {_cudnn.backend_version_string()} has no fused attention plan for "
                         f"B={B} S={S} heads={H}/{K} head_dim={Dh}{what}: "
                         f"{str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}") from None
    return _plans[key], True


def size_workspace(empty) -> None:
    """One workspace for all plans (they run one at a time on one stream), grown as needed."""
    need = max((p.workspace for plans in _plans.values() for p in plans), default=0)
    if need > _workspace["bytes"]:
        t = empty((max(need, 1),), "uint8")
        _workspace.update(bytes=need, tensor=t, ptr=t.data_ptr())


def warm(plan: Plan, empty) -> None:
    """Run `plan` once on scratch buffers: its kernels load now, outside any capture."""
    shape = {"q": "q", "o": "q", "do": "q", "dq": "q", "k": "kv", "v": "kv", "dk": "kv", "dv": "kv", "lse": "lse",
             "bias": "bias"}
    plan.run([empty(plan.shapes[shape[n]], "float32" if n == "lse" else "bfloat16") for n in plan.names],
             _workspace["ptr"])


def prepare(manifest, dev, art_dir=None) -> None:
    """Build (or find) the cuDNN plans of every attention call the artifact makes, size the
    shared workspace, run each plan once on scratch buffers, load the packed kernels of calls
    with mask "kernel" from art_dir (each run once too), and register the functions."""
    import tvm
    import tvm_ffi

    calls = [c for c in manifest.unit_calls if c.get("function") in FUNCTIONS]
    if not calls:
        return
    _init()
    empty = lambda shape, dtype: tvm.runtime.empty(tuple(shape), dtype, dev)  # noqa: E731
    ours = [c for c in calls if _mask(c) == "kernel"]
    fresh = [p for plans, new in (build_plan(call, empty) for call in calls if call not in ours) if new for p in plans]
    size_workspace(empty)
    _set_stream(dev.index)
    for plan in fresh:
        warm(plan, empty)
    for call in ours:
        load_kernels(manifest, call, art_dir, dev, empty)
    dev.sync()
    for name, fn in ((FWD, _forward), (BWD, _backward), (PACKED_FWD, _packed_forward), (PACKED_BWD, _packed_backward)):
        tvm_ffi.register_global_func(name, fn, override=True)


def load_kernels(manifest, call: dict, art_dir, dev, empty) -> None:
    """The packed kernels of a call with mask "kernel" (loaded once a shape), their scratch for
    its rows, and one run of each on scratch buffers for rows not seen before."""
    if art_dir is None:
        raise LoracError("a packed attention call with mask 'kernel' needs its artifact's directory")
    key, scale = _key(call)[:-1], float(call["scale"])
    if key in _kernels and _kernels[key][1] != scale:
        raise LoracError(f"two loaded artifacts make attention calls {key} with different softmax scales")
    shape = shape_of(call)
    backward = any(c.get("function") == PACKED_BWD and _mask(c) == "kernel" and shape_of(c) == shape
                   for c in manifest.unit_calls)  # the artifact's backward too: all four kernels, loaded once
    pk = _kernel_sets.get(shape)
    if pk is not None and backward and "bwd_kv" not in pk.kernels:  # loaded for an eval artifact: its forward alone
        pk = None
    if pk is None:
        pk = _kernel_sets[shape] = PackedKernels(find_entry(manifest, call), art_dir, dev.index, backward)
    fresh = call["B"] not in pk.delta
    pk.reserve(call["B"], empty)
    _kernels[key] = (pk, scale)
    if fresh:
        pk.warm(call["B"], call["pos_dtype"], scale, empty, _stream[0] or 0)


def feeder(manifest):
    """For an artifact with packed calls masking by ragged sequences or with lorac's kernels,
    the function its Step calls with each call's inputs before running it. Ragged: the
    documents of `position_ids` into the buffers its plans read (captured CUDA graphs replay
    with them). Kernels: a check that the positions number each document 0, 1, 2, ... (the
    kernels skip tiles by the documents' starts, so other positions would lose gradient
    silently); a LoracError names the first token that does not. None for other artifacts."""
    packed = [c for c in manifest.unit_calls if c.get("function") in _PACKED]
    shapes = {(c["B"], c["S"]) for c in packed if _mask(c) == "ragged"}
    checked = any(_mask(c) == "kernel" for c in packed)
    if not shapes and not checked:
        return None
    docs = [_documents[s] for s in sorted(shapes)]  # made by prepare() when the artifact opened

    def feed(inputs: dict) -> None:
        pos = inputs.get("position_ids")
        if pos is None:
            raise LoracError("this artifact's packed attention needs the input position_ids")
        pos = pos if isinstance(pos, np.ndarray) else np.asarray(pos.numpy())
        for d in docs:
            d.fill(pos)
        if checked and not docs:
            document_runs(pos)
    return feed


def _plans_for(fn: str, q, k, x=None) -> list:
    B, S, H, Dh = (int(d) for d in q.shape)
    mask = None if fn in (FWD, BWD) else ("bias" if len(x.shape) == 4 else "ragged")
    key = (fn, B, S, H, int(k.shape[2]), Dh, mask)
    plans = _plans.get(key)
    if plans is None:
        raise LoracError(f"no cuDNN attention plan for {key}: the artifact's manifest does not list this call")
    return plans


def _run(plans: list, buffers: list) -> None:
    for plan in plans:
        plan.run(buffers, _workspace["ptr"])


def _forward(q, k, v, o, lse) -> None:
    _set_stream(o.device.index)
    _run(_plans_for(FWD, q, k), [q, k, v, o, lse])


def _backward(q, k, v, o, do, lse, dq, dk, dv) -> None:
    _set_stream(dq.device.index)
    _run(_plans_for(BWD, q, k), [q, k, v, o, do, lse, dq, dk, dv])


def _ours(fn: str, q, k):
    """(PackedKernels, scale) where this packed call runs lorac's kernels, else None."""
    B, S, H, Dh = (int(d) for d in q.shape)
    return _kernels.get((fn, B, S, H, int(k.shape[2]), Dh))


def _packed_forward(q, k, v, x, o, lse) -> None:
    _set_stream(o.device.index)
    ours = _ours(PACKED_FWD, q, k)
    if ours:
        ours[0].forward(q, k, v, x, o, lse, ours[1], _stream[0] or 0)
        return
    plans = _plans_for(PACKED_FWD, q, k, x)
    _run(plans, [q, k, v, x, o, lse] if plans[0].layout == "bias" else [q, k, v, o, lse])


def _packed_backward(q, k, v, o, do, lse, x, dq, dk, dv) -> None:
    _set_stream(dq.device.index)
    ours = _ours(PACKED_BWD, q, k)
    if ours:
        ours[0].backward(q, k, v, o, do, lse, x, dq, dk, dv, ours[1], _stream[0] or 0)
        return
    plans = _plans_for(PACKED_BWD, q, k, x)
    _run(plans, [q, k, v, o, do, lse, x, dq, dk, dv] if plans[0].layout == "bias" else [q, k, v, o, do, lse, dq, dk, dv])
