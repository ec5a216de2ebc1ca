"""cuDNN fused attention (SDPA, flash-style) for CUDA artifacts, without torch.

The compiler maps the graph's attention units to two DPS calls (compiler/targets/cuda/attention.py):

    lorac.attention_fwd(q, k, v, o, lse)
    lorac.attention_bwd(q, k, v, o, do, lse, dq, dk, dv)

q, o, do, dq: bf16 [B, S, H, Dh]; k, v, dk, dv: bf16 [B, S, K, Dh] (token-major, read by
cuDNN through strides; K < H is grouped-query attention, native in cuDNN); lse: fp32
[B, H, S, 1], the log-sum-exp of each causal softmax row (cuDNN's "stats"). The softmax scale of each call shape comes from the manifest.

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

from ...errors import LoracError

FWD, BWD = "lorac.attention_fwd", "lorac.attention_bwd"

_cudnn = None  # the module, imported on first use
_handle = None
_stream = [None]
_get_stream = None
_plans: dict = {}  # (function, B, S, H, K, Dh) -> _Plan (scale from the manifest)
_workspace = {"bytes": 0, "tensor": None, "ptr": 0}


def _bshd(B, S, H, Dh) -> tuple[list, list]:
    """cuDNN dims [B, H, S, Dh] with the strides of a token-major [B, S, H, Dh] buffer."""
    return [B, H, S, Dh], [S * H * Dh, Dh, H * Dh, 1]


class _Plan:
    """One built cuDNN graph and the graph tensors its buffers bind to, in call order."""

    def __init__(self, fn: str, B: int, S: int, H: int, K: int, Dh: int, scale: float):
        c = _cudnn
        bf16, f32 = c.data_type.BFLOAT16, c.data_type.FLOAT
        g = c.pygraph(io_data_type=bf16, intermediate_data_type=f32, compute_data_type=f32, handle=_handle)
        q = g.tensor(*_bshd(B, S, H, Dh), data_type=bf16, name="q")
        k = g.tensor(*_bshd(B, S, K, Dh), data_type=bf16, name="k")
        v = g.tensor(*_bshd(B, S, K, Dh), data_type=bf16, name="v")
        if fn == FWD:
            o, lse = g.sdpa(q, k, v, attn_scale=scale, is_inference=False, use_causal_mask=True, name="sdpa")
            o.set_output(True).set_dim(_bshd(B, S, H, Dh)[0]).set_stride(_bshd(B, S, H, Dh)[1])
            lse.set_output(True).set_data_type(f32).set_dim([B, H, S, 1]).set_stride([H * S, S, 1, 1])
            self.tensors = [q, k, v, o, lse]
        else:
            o = g.tensor(*_bshd(B, S, H, Dh), data_type=bf16, name="o")
            do = g.tensor(*_bshd(B, S, H, Dh), data_type=bf16, name="do")
            lse = g.tensor([B, H, S, 1], [H * S, S, 1, 1], data_type=f32, name="lse")
            dq, dk, dv = g.sdpa_backward(q, k, v, o, do, lse, attn_scale=scale, use_causal_mask=True,
                                         name="sdpa_backward")
            for t, heads in ((dq, H), (dk, K), (dv, K)):
                t.set_output(True).set_dim(_bshd(B, S, heads, Dh)[0]).set_stride(_bshd(B, S, heads, Dh)[1])
            self.tensors = [q, k, v, o, do, lse, dq, dk, dv]
        g.build([c.heur_mode.A, c.heur_mode.FALLBACK])
        self.graph, self.scale = g, scale
        self.workspace = int(g.get_workspace_size())
        self.shapes = {"q": (B, S, H, Dh), "kv": (B, S, K, Dh), "lse": (B, H, S, 1)}

    def run(self, buffers: list) -> None:
        self.graph.execute({t: b.data_ptr() for t, b in zip(self.tensors, buffers)}, _workspace["ptr"],
                           handle=_handle)


def _init() -> None:
    global _cudnn, _handle, _get_stream
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
    import tvm_ffi
    _get_stream = tvm_ffi.LIB.TVMFFIEnvGetStream
    _get_stream.restype, _get_stream.argtypes = ctypes.c_void_p, [ctypes.c_int32, ctypes.c_int32]


def release() -> None:
    """Free the plans, the workspace and the handle, in that order, while the interpreter and
    the CUDA context are whole. Run at exit: otherwise the built graphs outlive Python's
    teardown and cuDNN's frontend (nanobind) prints hundreds of `nanobind: leaked ...` lines
    after the run's summary. A later prepare() starts afresh."""
    global _cudnn, _handle
    import gc
    _plans.clear()
    _workspace.update(bytes=0, tensor=None, ptr=0)
    gc.collect()  # graphs in reference cycles go now, not in the teardown
    if _handle is not None:
        try:
            _cudnn.destroy_handle(_handle)
        except Exception:  # noqa: BLE001 - at exit nothing is left to report it to
            pass
    _cudnn, _handle, _stream[0] = None, None, None


def _key(call: dict) -> tuple:
    return (call["function"], call["B"], call["S"], call["H"], call["K"], call["Dh"])


def _set_stream(device_index: int) -> None:
    stream = _get_stream(2, device_index)  # kDLCUDA
    if stream != _stream[0]:
        _cudnn.set_stream(_handle, stream or 0)
        _stream[0] = stream


def prepare(manifest, dev) -> None:
    """Build (or find) the cuDNN plan of every attention call the artifact makes, size the
    shared workspace, run each plan once on scratch buffers, and register the functions."""
    import tvm
    import tvm_ffi

    calls = [c for c in manifest.unit_calls if c.get("function") in (FWD, BWD)]
    if not calls:
        return
    _init()
    fresh = []
    for call in calls:
        key = _key(call)
        plan = _plans.get(key)
        if plan is not None and plan.scale != float(call["scale"]):
            raise LoracError(f"two loaded artifacts make attention calls {key} with different softmax scales")
        if plan is None:
            try:
                _plans[key] = _Plan(*key, float(call["scale"]))
            except Exception as e:  # cuDNN raises its own error types
                raise LoracError(f"cuDNN {_cudnn.backend_version_string()} has no fused attention plan for "
                                 f"B={key[1]} S={key[2]} heads={key[3]}/{key[4]} head_dim={key[5]}: "
                                 f"{str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}") from None
            fresh.append(_plans[key])
    need = max(p.workspace for p in _plans.values())
    if need > _workspace["bytes"]:  # one workspace for all plans: they run one at a time on one stream
        t = tvm.runtime.empty((max(need, 1),), "uint8", dev)
        _workspace.update(bytes=need, tensor=t, ptr=t.data_ptr())
    _set_stream(dev.index)
    for plan in fresh:  # loads its kernels now, outside any capture
        scratch = {n: tvm.runtime.empty(s, "float32" if n == "lse" else "bfloat16", dev) for n, s in plan.shapes.items()}
        q, kv, lse = scratch["q"], scratch["kv"], scratch["lse"]
        if len(plan.tensors) == 5:
            plan.run([q, kv, kv, tvm.runtime.empty(q.shape, "bfloat16", dev), lse])
        else:
            out = [tvm.runtime.empty(x.shape, "bfloat16", dev) for x in (q, kv, kv)]
            plan.run([q, kv, kv, q, q, lse, *out])
    dev.sync()
    tvm_ffi.register_global_func(FWD, _forward, override=True)
    tvm_ffi.register_global_func(BWD, _backward, override=True)


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
