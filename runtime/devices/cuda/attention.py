"""cuDNN fused attention (SDPA, flash-style) for CUDA artifacts, without torch.

The compiler maps the graph's attention units to DPS calls (compiler/targets/cuda/attention.py):

    lorac.attention_fwd(q, k, v, o, lse)
    lorac.attention_bwd(q, k, v, o, do, lse, dq, dk, dv)
    lorac.attention_packed_fwd(q, k, v, pos, o, lse)                 --packing isolated
    lorac.attention_packed_bwd(q, k, v, o, do, lse, pos, dq, dk, dv)

q, o, do, dq: bf16 [B, S, H, Dh]; k, v, dk, dv: bf16 [B, S, K, Dh] (token-major, read by
cuDNN through strides; K < H is grouped-query attention, native in cuDNN); lse: fp32, the
log-sum-exp of each causal softmax row (cuDNN's "stats"), [B, H, S, 1] for plain rows and
token-major [B, S, H, 1] for packed ones. The softmax scale of each call shape comes from
the manifest.

Packed rows (documents each attending only within itself, position ids `pos` [B, S]) use
cuDNN's ragged (THD) layout: each document is a sequence of its own, given by its length
and the offset of its first token (runtime/devices/cuda/documents.py), with causal masking
inside each sequence. Those lengths and offsets live in device buffers per [B, S] shape,
filled from the batch's position_ids before each call of the artifact (`feeder`, which the
artifact's Step calls), so a captured CUDA graph replays with each batch's documents; the
`pos` argument itself is not read. A plan has a fixed number of sequences: B times the most
documents a row holds (`reserve_documents`, from the run's data; every token a document when
nothing was reserved); a batch with fewer documents leaves the rest empty.

cuDNN comes from NVIDIA's pip wheels (nvidia-cudnn-frontend's Python graph API over
nvidia-cudnn-cu13's libcudnn). Plans are built when the artifact loads, from the shapes
the manifest lists (`unit_calls`), and each is executed once on scratch buffers then: the
first step of a CUDA-graph artifact is captured, and building plans, loading kernels or
allocating inside a capture is not allowed. Calls run on the stream TVM names (the
capture stream while a graph records), like the cuBLAS GEMMs (runtime/devices/cuda/cublas.py).
At exit release() frees the plans and the handle before Python's teardown, so a run ends on
its summary rather than on cuDNN frontend's leak report.
"""
from __future__ import annotations

import ctypes

import numpy as np

from ...errors import LoracError
from .documents import split_documents

FWD, BWD = "lorac.attention_fwd", "lorac.attention_bwd"
PACKED_FWD, PACKED_BWD = "lorac.attention_packed_fwd", "lorac.attention_packed_bwd"
FUNCTIONS = (FWD, BWD, PACKED_FWD, PACKED_BWD)
_PACKED = (PACKED_FWD, PACKED_BWD)

_cudnn = None  # the module, imported on first use
_handle = None
_stream = [None]
_get_stream = None
_plans: dict = {}  # (function, B, S, H, K, Dh) -> _Plan (scale from the manifest)
_documents: dict = {}  # (B, S) -> _Documents: what the packed calls of that shape read
_per_row = [None]  # reserve_documents: the most documents a row holds (None: S)
_workspace = {"bytes": 0, "tensor": None, "ptr": 0}
# ways to ask for the causal mask, tried in order until a plan builds (frontend versions differ)
CAUSAL = ({"use_causal_mask": True}, {"diagonal_band_right_bound": 0, "diagonal_alignment": "TOP_LEFT"})


def _bshd(B, S, H, Dh) -> tuple[list, list]:
    """cuDNN dims [B, H, S, Dh] with the strides of a token-major [B, S, H, Dh] buffer (with
    ragged offsets B counts sequences and each sequence's start comes from its offset)."""
    return [B, H, S, Dh], [S * H * Dh, Dh, H * Dh, 1]


def _round64(n: int) -> int:
    return max(64, -(-n // 64) * 64)


class _Documents:
    """The device buffers the packed calls of one [B, S] shape read: each sequence's length
    (int32 [N]) and, per elements-per-token count m (H*Dh for q/o/do/dq, K*Dh for k/v/dk/dv,
    H for lse), the element offset of each sequence's first token (int64 [N + 1]). N =
    capacity, B x the documents a row may hold unless given. `empty(shape, dtype)` allocates
    a device buffer with copyfrom(numpy) and data_ptr()."""

    def __init__(self, B: int, S: int, per_row: int, empty, capacity: int | None = None):
        self.B, self.S, self.capacity = B, S, capacity or B * per_row
        self._empty = empty
        self.lengths = empty((self.capacity,), "int32")
        self.offsets: dict = {}
        self._starts = None
        self.fill(np.broadcast_to(np.arange(S, dtype=np.int64), (B, S)))  # one document a row until a batch comes

    def offsets_of(self, per_token: int):
        buf = self.offsets.get(per_token)
        if buf is None:
            buf = self.offsets[per_token] = self._empty((self.capacity + 1,), "int64")
            buf.copyfrom(self._starts * per_token)
        return buf

    def fill(self, positions) -> None:
        """Lengths and offsets of the documents of `positions` [B, S] (numpy)."""
        pos = np.asarray(positions)
        if pos.shape != (self.B, self.S):
            raise LoracError(f"position_ids {list(pos.shape)}: the packed attention runs [{self.B}, {self.S}] rows")
        lengths, self._starts = split_documents(pos, self.capacity)
        self.lengths.copyfrom(lengths)
        for m, buf in self.offsets.items():
            buf.copyfrom(self._starts * m)


class _Plan:
    """One built cuDNN graph and the graph tensors its buffers bind to, in call order (packed:
    also the documents' lengths and offsets, bound to their buffers once)."""

    def __init__(self, fn: str, B: int, S: int, H: int, K: int, Dh: int, scale: float, docs: _Documents | None = None):
        self.scale, self.docs = scale, docs
        self.shapes = {"q": (B, S, H, Dh), "kv": (B, S, K, Dh), "lse": (B, S, H, 1) if docs else (B, H, S, 1)}
        self.failed = []  # (causal spelling, cuDNN's error) of each spelling tried before the one built
        for causal in CAUSAL:
            try:
                self._build(fn, B, S, H, K, Dh, scale, docs, causal)
                return
            except Exception as e:  # noqa: BLE001 - cuDNN raises its own error types; the first one is reported
                self.failed.append((causal, e))
        raise self.failed[0][1]

    def _build(self, fn, B, S, H, K, Dh, scale, docs, causal) -> None:
        c = _cudnn
        bf16, f32 = c.data_type.BFLOAT16, c.data_type.FLOAT
        causal = {k: getattr(c.diagonal_alignment, v) if k == "diagonal_alignment" else v for k, v in causal.items()}
        n = docs.capacity if docs else B  # cuDNN's batch: the sequences
        g = c.pygraph(io_data_type=bf16, intermediate_data_type=f32, compute_data_type=f32, handle=_handle)
        q = g.tensor(*_bshd(n, S, H, Dh), data_type=bf16, name="q")
        k = g.tensor(*_bshd(n, S, K, Dh), data_type=bf16, name="k")
        v = g.tensor(*_bshd(n, S, K, Dh), data_type=bf16, name="v")
        # lse [B, H, S, 1]; packed: token-major [tokens, H] (each sequence's rows at its offset)
        lse_dims, lse_strides = [n, H, S, 1], ([S * H, 1, H, 1] if docs else [H * S, S, 1, 1])
        mask, bound, ragged = dict(causal), {}, {}
        if docs:
            lens = [g.tensor([n, 1, 1, 1], [1, 1, 1, 1], data_type=c.data_type.INT32, name=f"seq_len_{x}") for x in "qk"]
            ragged = {m: g.tensor([n + 1, 1, 1, 1], [1, 1, 1, 1], data_type=c.data_type.INT64, name=f"ragged_{m}")
                      for m in sorted({H * Dh, K * Dh, H})}
            q.set_ragged_offset(ragged[H * Dh])
            k.set_ragged_offset(ragged[K * Dh])
            v.set_ragged_offset(ragged[K * Dh])
            mask.update(use_padding_mask=True, seq_len_q=lens[0], seq_len_kv=lens[1])
            bound = {lens[0]: docs.lengths, lens[1]: docs.lengths, **{t: docs.offsets_of(m) for m, t in ragged.items()}}
        if fn in (FWD, PACKED_FWD):
            o, lse = g.sdpa(q, k, v, attn_scale=scale, is_inference=False, name="sdpa", **mask)
            o.set_output(True).set_dim(_bshd(n, S, H, Dh)[0]).set_stride(_bshd(n, S, H, Dh)[1])
            lse.set_output(True).set_data_type(f32).set_dim(lse_dims).set_stride(lse_strides)
            if docs:
                o.set_ragged_offset(ragged[H * Dh])
                lse.set_ragged_offset(ragged[H])
            self.tensors = [q, k, v, o, lse]
        else:
            o = g.tensor(*_bshd(n, S, H, Dh), data_type=bf16, name="o")
            do = g.tensor(*_bshd(n, S, H, Dh), data_type=bf16, name="do")
            lse = g.tensor(lse_dims, lse_strides, data_type=f32, name="lse")
            if docs:
                for t, m in ((o, H * Dh), (do, H * Dh), (lse, H)):
                    t.set_ragged_offset(ragged[m])
                # the sizes of cuDNN's own accumulators (dq in fp32): the tokens, not sequences x S
                mask.update(max_total_seq_len_q=_round64(B * S), max_total_seq_len_kv=_round64(B * S))
            dq, dk, dv = g.sdpa_backward(q, k, v, o, do, lse, attn_scale=scale, name="sdpa_backward", **mask)
            for t, heads in ((dq, H), (dk, K), (dv, K)):
                t.set_output(True).set_dim(_bshd(n, S, heads, Dh)[0]).set_stride(_bshd(n, S, heads, Dh)[1])
                if docs:
                    t.set_ragged_offset(ragged[heads * Dh])
            self.tensors = [q, k, v, o, do, lse, dq, dk, dv]
        g.build([c.heur_mode.A, c.heur_mode.FALLBACK])
        self.graph = g
        self.workspace = int(g.get_workspace_size())
        self.bound = {t: b.data_ptr() for t, b in bound.items()}
        self.causal = causal

    def run(self, buffers: list) -> None:
        self.graph.execute({**{t: b.data_ptr() for t, b in zip(self.tensors, buffers)}, **self.bound},
                           _workspace["ptr"], handle=_handle)


def _init() -> None:
    global _cudnn, _handle
    if _handle is not None:
        return
    from .cublas import load_library
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
    _workspace.update(bytes=0, tensor=None, ptr=0)
    gc.collect()  # graphs in reference cycles go now, not in the teardown
    if _handle is not None:
        try:
            _cudnn.destroy_handle(_handle)
        except Exception:  # noqa: BLE001 - at exit nothing is left to report it to
            pass
    _cudnn, _handle, _stream[0] = None, None, None


def reserve_documents(per_row: int) -> None:
    """The most documents one row of the run's data holds (--packing isolated): the packed
    plans of shapes prepared from now on hold that many sequences a row."""
    _per_row[0] = max(int(per_row), 1)


def _key(call: dict) -> tuple:
    return (call["function"], call["B"], call["S"], call["H"], call["K"], call["Dh"])


def _set_stream(device_index: int) -> None:
    global _get_stream
    if _get_stream is None:  # TVM launches its kernels on the stream this names (a capture stream while recording)
        import tvm_ffi
        _get_stream = tvm_ffi.LIB.TVMFFIEnvGetStream
        _get_stream.restype, _get_stream.argtypes = ctypes.c_void_p, [ctypes.c_int32, ctypes.c_int32]
    stream = _get_stream(2, device_index)  # kDLCUDA
    if stream != _stream[0]:
        _cudnn.set_stream(_handle, stream or 0)
        _stream[0] = stream


def documents_for(B: int, S: int, empty) -> _Documents:
    """The lengths and offsets buffers of packed [B, S] rows, made on first use (`empty`:
    the device allocator, _Documents)."""
    docs = _documents.get((B, S))
    if docs is None:
        docs = _documents[(B, S)] = _Documents(B, S, min(_per_row[0] or S, S), empty)
    return docs


def build_plan(call: dict, empty) -> tuple[_Plan, bool]:
    """(the plan of a manifest's call, whether it was built now)."""
    key = _key(call)
    plan = _plans.get(key)
    if plan is not None and plan.scale != float(call["scale"]):
        raise LoracError(f"two loaded artifacts make attention calls {key} with different softmax scales")
    if plan is not None:
        return plan, False
    docs = documents_for(call["B"], call["S"], empty) if call["function"] in _PACKED else None
    try:
        _plans[key] = _Plan(*key, float(call["scale"]), docs)
    except Exception as e:  # cuDNN raises its own error types
        what = f" packed in {docs.capacity} sequences" if docs else ""
        raise LoracError(f"cuDNN {_cudnn.backend_version_string()} has no fused attention plan for "
                         f"B={key[1]} S={key[2]} heads={key[3]}/{key[4]} head_dim={key[5]}{what}: "
                         f"{str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}") from None
    return _plans[key], True


def size_workspace(empty) -> None:
    """One workspace for all plans (they run one at a time on one stream), grown as needed."""
    need = max((p.workspace for p in _plans.values()), default=0)
    if need > _workspace["bytes"]:
        t = empty((max(need, 1),), "uint8")
        _workspace.update(bytes=need, tensor=t, ptr=t.data_ptr())


def warm(plan: _Plan, empty) -> None:
    """Run `plan` once on scratch buffers: its kernels load now, outside any capture."""
    scratch = {n: empty(s, "float32" if n == "lse" else "bfloat16") for n, s in plan.shapes.items()}
    q, kv, lse = scratch["q"], scratch["kv"], scratch["lse"]
    if len(plan.tensors) == 5:
        plan.run([q, kv, kv, empty(plan.shapes["q"], "bfloat16"), lse])
    else:
        out = [empty(plan.shapes[n], "bfloat16") for n in ("q", "kv", "kv")]
        plan.run([q, kv, kv, q, q, lse, *out])


def prepare(manifest, dev) -> None:
    """Build (or find) the cuDNN plan of every attention call the artifact makes, size the
    shared workspace, run each plan once on scratch buffers, and register the functions."""
    import tvm
    import tvm_ffi

    calls = [c for c in manifest.unit_calls if c.get("function") in FUNCTIONS]
    if not calls:
        return
    _init()
    empty = lambda shape, dtype: tvm.runtime.empty(tuple(shape), dtype, dev)  # noqa: E731
    fresh = [plan for plan, new in (build_plan(call, empty) for call in calls) if new]
    size_workspace(empty)
    _set_stream(dev.index)
    for plan in fresh:
        warm(plan, empty)
    dev.sync()
    for name, fn in ((FWD, _forward), (BWD, _backward), (PACKED_FWD, _packed_forward), (PACKED_BWD, _packed_backward)):
        tvm_ffi.register_global_func(name, fn, override=True)


def feeder(manifest):
    """For an artifact with packed attention calls, the function its Step calls with each
    call's inputs before running it: the documents of `position_ids` into the buffers its
    plans read (captured CUDA graphs replay with them). None for other artifacts."""
    shapes = {(c["B"], c["S"]) for c in manifest.unit_calls if c.get("function") in _PACKED}
    if not shapes:
        return None
    docs = [_documents[s] for s in sorted(shapes)]  # made by prepare() when the artifact opened

    def feed(inputs: dict) -> None:
        pos = inputs.get("position_ids")
        if pos is None:
            raise LoracError("this artifact's packed attention needs the input position_ids")
        pos = pos if isinstance(pos, np.ndarray) else np.asarray(pos.numpy())
        for d in docs:
            d.fill(pos)
    return feed


def _plan_for(fn: str, q, k) -> _Plan:
    B, S, H, Dh = (int(d) for d in q.shape)
    key = (fn, B, S, H, int(k.shape[2]), Dh)
    plan = _plans.get(key)
    if plan is None:
        raise LoracError(f"no cuDNN attention plan for {key}: the artifact's manifest does not list this call")
    return plan


def _forward(q, k, v, o, lse) -> None:
    _set_stream(o.device.index)
    _plan_for(FWD, q, k).run([q, k, v, o, lse])


def _backward(q, k, v, o, do, lse, dq, dk, dv) -> None:
    _set_stream(dq.device.index)
    _plan_for(BWD, q, k).run([q, k, v, o, do, lse, dq, dk, dv])


def _packed_forward(q, k, v, _pos, o, lse) -> None:
    _set_stream(o.device.index)
    _plan_for(PACKED_FWD, q, k).run([q, k, v, o, lse])


def _packed_backward(q, k, v, o, do, lse, _pos, dq, dk, dv) -> None:
    _set_stream(dq.device.index)
    _plan_for(PACKED_BWD, q, k).run([q, k, v, o, do, lse, dq, dk, dv])
