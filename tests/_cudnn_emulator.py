"""A host emulator of the part of cuDNN's Python frontend lorac's attention uses (the `cudnn`
module: pygraph, tensor, sdpa, sdpa_backward, execute), for tests without a GPU.

It does what the frontend's documentation and its own tests say the graph means, reading and
writing host memory at the bound addresses: a tensor is dims [B, H, S, D] with element
strides; with a ragged offset, sequence b starts at element ragged[b] of the buffer (the
batch stride is not used) and holds seq_len[b] tokens; causal masking is within each
sequence (top-left: query r sees keys 0..r); stats are the natural log-sum-exp of each
scaled, masked score row (plus the bias [B|1, 1, S, S] where one is given); the backward
recomputes the probabilities from them. bf16 values are rounded to nearest even when written.
Every graph offers two plans (PLANS) that compute the same. So a test can check what lorac *describes* to
cuDNN (dims, strides, which offsets go with which tensor, the stats layout), not cuDNN.
"""
from __future__ import annotations

import ctypes
from types import SimpleNamespace

import numpy as np

__version__ = "emulated"
data_type = SimpleNamespace(BFLOAT16="bfloat16", FLOAT="float32", INT32="int32", INT64="int64", HALF="float16")
heur_mode = SimpleNamespace(A="A", FALLBACK="FALLBACK")
diagonal_alignment = SimpleNamespace(TOP_LEFT="TOP_LEFT", BOTTOM_RIGHT="BOTTOM_RIGHT")
attention_implementation = SimpleNamespace(AUTO="AUTO", COMPOSITE="COMPOSITE", UNIFIED="UNIFIED")
build_plan_policy = SimpleNamespace(HEURISTICS_CHOICE="HEURISTICS_CHOICE", ALL="ALL")
PLANS = ("emulated_0", "emulated_1")  # the plans every graph offers (the names of get_plan_name_at_index)
_CT = {"bfloat16": ctypes.c_uint16, "float32": ctypes.c_float, "int32": ctypes.c_int32, "int64": ctypes.c_int64}
stream_of = {}


def backend_version_string():
    return "emulated"


def create_handle():
    return object()


def destroy_handle(handle):
    stream_of.pop(id(handle), None)


def set_stream(handle, stream):
    stream_of[id(handle)] = stream


class Tensor:
    def __init__(self, dim, stride, data_type=None, name=""):
        self.dim, self.stride, self.data_type, self.name = list(dim), list(stride), data_type, name
        self.ragged = None

    def set_output(self, _flag):
        return self

    def set_dim(self, dim):
        self.dim = list(dim)
        return self

    def set_stride(self, stride):
        self.stride = list(stride)
        return self

    def set_data_type(self, dt):
        self.data_type = dt
        return self

    def set_ragged_offset(self, t):
        self.ragged = t
        return self


def _view(ptr: int, dtype: str, count: int) -> np.ndarray:
    return np.ctypeslib.as_array((_CT[dtype] * count).from_address(ptr))


def _read(t: Tensor, ptrs: dict, seq_len: np.ndarray | None) -> list:
    """Per batch entry (sequence), the [H, L, D] float64 values (L = its length)."""
    B, H, S, D = t.dim
    base = _bases(t, ptrs, B)
    out = []
    for b in range(B):
        L = S if seq_len is None else int(seq_len[b])
        idx = base[b] + np.arange(H)[:, None, None] * t.stride[1] + np.arange(L)[None, :, None] * t.stride[2] \
            + np.arange(D)[None, None, :] * t.stride[3]
        flat = _view(ptrs[id(t)], t.data_type, int(idx.max()) + 1 if idx.size else 0) if idx.size else None
        vals = flat[idx] if idx.size else np.zeros((H, 0, D))
        if t.data_type == "bfloat16":
            vals = (vals.astype(np.uint32) << 16).view(np.float32)
        out.append(np.asarray(vals, np.float64))
    return out


def _write(t: Tensor, ptrs: dict, seq_len, values: list) -> None:
    B, H, S, D = t.dim
    base = _bases(t, ptrs, B)
    for b in range(B):
        v = values[b]
        if v.size == 0:
            continue
        L = v.shape[1]
        idx = base[b] + np.arange(H)[:, None, None] * t.stride[1] + np.arange(L)[None, :, None] * t.stride[2] \
            + np.arange(D)[None, None, :] * t.stride[3]
        flat = _view(ptrs[id(t)], t.data_type, int(idx.max()) + 1)
        if t.data_type == "bfloat16":
            u = v.astype(np.float32).view(np.uint32)
            v = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)  # round to nearest even
        flat[idx] = v


def _bases(t: Tensor, ptrs: dict, B: int) -> np.ndarray:
    if t.ragged is None:
        return np.arange(B) * t.stride[0]
    return _view(ptrs[id(t.ragged)], "int64", B + 1)[:B].astype(np.int64)


class pygraph:  # noqa: N801 - the frontend's name
    def __init__(self, io_data_type=None, intermediate_data_type=None, compute_data_type=None, handle=None):
        self.ops, self.built, self.selected = [], False, 0

    def tensor(self, dim, stride, data_type=None, name=""):
        return Tensor(dim, stride, data_type, name)

    def _mask(self, kw):
        causal = kw.get("use_causal_mask") or (kw.get("diagonal_band_right_bound") == 0
                                               and kw.get("diagonal_alignment") == "TOP_LEFT")
        assert causal, f"emulated: causal attention only ({kw})"
        lens = (kw["seq_len_q"], kw["seq_len_kv"]) if kw.get("use_padding_mask") else None
        return lens, kw.get("diagonal_band_left_bound")

    def sdpa(self, q, k, v, attn_scale, is_inference=True, name="", bias=None, implementation=None, **kw):
        o = Tensor(q.dim, q.stride, q.data_type, "o")
        stats = Tensor(q.dim[:3] + [1], [1, 1, 1, 1], "float32", "stats")
        lens, band = self._mask(kw)
        self.ops.append(("fwd", dict(q=q, k=k, v=v, o=o, stats=stats, scale=attn_scale, lens=lens, band=band, bias=bias)))
        return o, stats

    def sdpa_backward(self, q, k, v, o, do, stats, attn_scale, name="", bias=None, use_deterministic_algorithm=False,
                      max_total_seq_len_q=None, max_total_seq_len_kv=None, **kw):
        grads = [Tensor(x.dim, x.stride, x.data_type, f"d{x.name}") for x in (q, k, v)]
        lens, band = self._mask(kw)
        self.ops.append(("bwd", dict(q=q, k=k, v=v, o=o, do=do, stats=stats, dq=grads[0], dk=grads[1], dv=grads[2],
                                     scale=attn_scale, lens=lens, band=band, bias=bias)))
        return grads

    def build(self, _heuristics):
        self.built = True

    # the staged build (validate ... build_plans) and the plan list
    def validate(self):
        pass

    def build_operation_graph(self):
        pass

    def create_execution_plans(self, _heuristics):
        pass

    def check_support(self):
        pass

    def get_execution_plan_count(self):
        return len(PLANS)

    def get_plan_name_at_index(self, index):
        return PLANS[index]

    def select_plan(self, index):
        self.selected = index
        return self

    def build_plans(self, *_policy):
        self.built = True

    def execute_plan_at_index(self, bindings, workspace, index, handle=None):
        self.execute(bindings, workspace, handle)

    def get_workspace_size(self):
        return 256

    def execute(self, bindings: dict, workspace, handle=None):
        with np.errstate(all="ignore"):  # scratch runs (attention.warm) read uninitialized memory
            self._execute(bindings, workspace)

    def _execute(self, bindings: dict, workspace):
        assert self.built and workspace
        ptrs = {id(t): int(p) for t, p in bindings.items()}
        for kind, a in self.ops:
            for x in a.values():
                if isinstance(x, Tensor):
                    assert id(x) in ptrs, f"emulated: {x.name} not bound"
                    assert x.ragged is None or id(x.ragged) in ptrs, f"emulated: ragged offset of {x.name} not bound"
            B = a["q"].dim[0]
            lens = None if a["lens"] is None else [_view(ptrs[id(t)], "int32", B).copy() for t in a["lens"]]
            assert lens is None or np.array_equal(*lens)
            L = None if lens is None else lens[0]
            q, k, v = (_read(a[n], ptrs, L) for n in "qkv")
            G = a["q"].dim[1] // a["k"].dim[1]
            bias = _bias(a["bias"], ptrs, B)
            if kind == "fwd":
                res = [_forward(qq, np.repeat(kk, G, 0), np.repeat(vv, G, 0), a["scale"], bb, a["band"])
                       for qq, kk, vv, bb in zip(q, k, v, bias)]
                _write(a["o"], ptrs, L, [r[0] for r in res])
                _write(a["stats"], ptrs, L, [r[1][..., None] for r in res])
            else:
                o, do, stats = (_read(a[n], ptrs, L) for n in ("o", "do", "stats"))
                res = [_backward(*x, a["scale"], G, a["band"]) for x in zip(q, k, v, o, do, stats, bias)]
                for i, n in enumerate(("dq", "dk", "dv")):
                    _write(a[n], ptrs, L, [r[i] for r in res])


def _bias(t, ptrs: dict, B: int) -> list:
    """Per batch entry, the bias [1, S, S] (float64) or 0.0 without one (dims [B or 1, 1, S, S], bf16 or fp32)."""
    if t is None:
        return [0.0] * B
    assert t.dim[1] == 1 and t.data_type in ("bfloat16", "float32"), f"emulated: bias [B, 1, S, S], got {t.dim}"
    S, S2 = t.dim[2:]
    out = []
    for b in range(B):
        base = (b if t.dim[0] > 1 else 0) * t.stride[0]
        idx = base + np.arange(S)[:, None] * t.stride[2] + np.arange(S2)[None, :] * t.stride[3]
        vals = _view(ptrs[id(t)], t.data_type, int(idx.max()) + 1)[idx]
        if t.data_type == "bfloat16":
            vals = (vals.astype(np.uint32) << 16).view(np.float32)
        out.append(np.asarray(vals, np.float64)[None])
    return out


def _scores(q, kk, scale, bias=0.0, band=None):
    """Scaled scores, causal; with a left band bound W keys W or more positions before the query are masked."""
    L = q.shape[1]
    s = np.einsum("hid,hjd->hij", q, kk) * scale + (bias[:, :L, :L] if np.ndim(bias) else bias)
    keep = np.tril(np.ones((L, L), bool))
    if band is not None:
        keep &= ~np.tril(np.ones((L, L), bool), -int(band))
    return np.where(keep, s, -np.inf)


def _forward(q, kk, vv, scale, bias=0.0, band=None):
    if q.shape[1] == 0:
        return q.copy(), np.zeros(q.shape[:2])
    s = _scores(q, kk, scale, bias, band)
    m = s.max(-1, keepdims=True)
    lse = (m + np.log(np.exp(s - m).sum(-1, keepdims=True)))[..., 0]
    return np.einsum("hij,hjd->hid", np.exp(s - lse[..., None]), vv), lse


def _backward(q, k, v, o, do, stats, bias, scale, G, band=None):
    if q.shape[1] == 0:
        return q.copy(), k.copy(), v.copy()
    kk, vv = np.repeat(k, G, 0), np.repeat(v, G, 0)
    p = np.exp(_scores(q, kk, scale, bias, band) - stats)  # stats [H, L, 1]
    dp = np.einsum("hid,hjd->hij", do, vv)
    ds = p * (dp - (do * o).sum(-1, keepdims=True)) * scale
    fold = lambda x: x.reshape(k.shape[0], G, *x.shape[1:]).sum(1)  # noqa: E731 - each kv head's group
    return (np.einsum("hij,hjd->hid", ds, kk), fold(np.einsum("hij,hid->hjd", ds, q)),
            fold(np.einsum("hij,hid->hjd", p, do)))
