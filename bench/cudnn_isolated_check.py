"""cuDNN's packed (isolated) attention on the GPU: lorac's runtime path against fp32 torch
attention run per document, and its time against the plain causal cuDNN call.

On the H200 machine (python 3.12, torch and the image's nvidia-cudnn-cu13; cuDNN's Python
frontend from .devcarry/rt.tar.xz; no compiled artifact), from the repo root:

    source bench/h200_env.sh && python3 bench/cudnn_isolated_check.py --json $OUT/cudnn_isolated.json

Here, on the CPU, the same stages run against an emulator of the frontend (tests/_cudnn_emulator.py)
at a small shape, which checks this script, not cuDNN:

    python bench/cudnn_isolated_check.py --emulate

It exercises runtime/devices/cuda/attention.py directly (its _Documents and _Plan, on torch's
device buffers), not a compiled step. Stages, each reported on its own (one failing does not
stop the others; the JSON is rewritten after each):
  env       python, torch, CUDA, GPU, cuDNN frontend and backend versions, libcudnn's path
  data      B=8 rows of S=1024 tokens, each packing 4..40 documents of random lengths
            (length-1 documents among them, first and last in a row too), GQA 16/8 heads, Dh 128
  exact     packed forward + backward plans built for the batch's document count: O, LSE, dQ, dK,
            dV (bf16) against fp32 attention per document alone (torch, TF32 off): max |err|,
            max |ref|, cosine (ok: cosine >= 0.999 and no NaN); nothing written past the tokens
  padded    the same with B x 40 sequences, the unused ones empty (length 0, starting at the
            end): what the runtime builds (reserve_documents) - cuDNN and zero-length sequences
  replay    forward + backward captured in a CUDA graph, then replayed twice after the document
            buffers and the inputs were refilled with other batches (what lorac's captured step does)
  time      the packed calls (exact and padded) against the plain causal cuDNN call on the same
            tensors (median of CUDA-event timings), and the host time of one documents fill
  variants  when exact or padded failed (or --variants): empty sequences starting at 0; dummy
            1-token sequences over a scratch token; stats in the padded (non-ragged) layout
  tvm       when TVM's runtime imports (h200_env.sh): prepare() + feeder() + the registered
            global functions on DLPack views of the same tensors (the path a compiled step calls)
Exit status 0 when exact, padded and replay passed.
"""
from __future__ import annotations

import argparse
import ctypes
import glob
import json
import os
import shutil
import site
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
REPORT: dict = {"stages": {}}
ARGS = None


def save() -> None:
    if ARGS and ARGS.json:
        Path(ARGS.json).write_text(json.dumps(REPORT, indent=1, default=str))


def stage(name: str, fn, *args):
    """Run one stage: its result dict (with "ok") or the error, printed and kept in REPORT."""
    print(f"\n== {name}", flush=True)
    t0 = time.time()
    try:
        out = fn(*args) or {}
    except Exception as e:  # noqa: BLE001 - every stage reports on its own
        print(traceback.format_exc()[-4000:], flush=True)
        out = {"ok": False, "error": f"{type(e).__name__}: {str(e).strip()[:3000]}"}
    out.setdefault("ok", True)
    out["seconds"] = round(time.time() - t0, 2)
    REPORT["stages"][name] = out
    save()
    print(f"-- {name}: {'ok' if out['ok'] else 'FAILED'} ({out['seconds']} s)"
          + (f": {out['error'][:300]}" if "error" in out else ""), flush=True)
    return out


# -- imports -------------------------------------------------------------------------------
def import_attention():
    """lorac's runtime module (needs neither TVM nor the compiler): through the installed or
    shimmed package, else a shim made here (as bench/h200_env.sh makes one)."""
    try:
        from lorac.runtime.devices.cuda import attention
        return attention
    except ImportError:
        pass
    shim = Path(tempfile.mkdtemp(prefix="lorac-shim-"))
    (shim / "lorac").mkdir()
    for p in ("core", "graphs", "compiler", "runtime"):
        (shim / "lorac" / p).symlink_to(REPO / p)
    shutil.copy(REPO / "lorac_pkg" / "__init__.py", shim / "lorac" / "__init__.py")
    sys.path.insert(0, str(shim))
    for m in [m for m in sys.modules if m == "lorac" or m.startswith("lorac.")]:
        del sys.modules[m]
    from lorac.runtime.devices.cuda import attention
    return attention


def libcudnn() -> str | None:
    """libcudnn.so.9 of the nvidia-cudnn-cu13 wheel (loaded before the frontend dlopens it by name)."""
    roots = site.getsitepackages() + [site.getusersitepackages()] + sys.path
    for r in roots:
        for g in sorted(glob.glob(os.path.join(str(r), "nvidia", "*", "lib", "libcudnn.so.9"))):
            return g
    return None


# -- buffers -------------------------------------------------------------------------------
class Buffer:
    """A torch tensor with the interface lorac's runtime takes of device buffers."""

    def __init__(self, shape, dtype: str):
        import torch
        dt = {"bfloat16": torch.bfloat16, "float32": torch.float32, "int32": torch.int32, "int64": torch.int64,
              "uint8": torch.uint8}[dtype]
        self.t = torch.zeros(tuple(int(s) for s in shape), dtype=dt, device=DEV)

    def copyfrom(self, a: np.ndarray) -> None:
        import torch
        self.t.copy_(torch.from_numpy(np.ascontiguousarray(a)))

    def data_ptr(self) -> int:
        return self.t.data_ptr()


def empty(shape, dtype):
    return Buffer(shape, dtype)


def sync() -> None:
    import torch
    if DEV == "cuda":
        torch.cuda.synchronize()


def set_stream(att) -> None:
    import torch
    att._cudnn.set_stream(att._handle, torch.cuda.current_stream().cuda_stream if DEV == "cuda" else 0)


def ensure_workspace(att, *plans) -> None:
    import torch
    need = max(p.workspace for p in plans)
    if need > att._workspace["bytes"]:
        t = torch.empty(max(need, 1), dtype=torch.uint8, device=DEV)
        att._workspace.update(bytes=need, tensor=t, ptr=t.data_ptr())


# -- data ----------------------------------------------------------------------------------
def row_lengths(rng, S: int, n: int, ones: int) -> list[int]:
    """n document lengths summing to S, `ones` of them one token long (the first of the row
    when ones >= 1, the last when >= 2, the others anywhere)."""
    rest = n - ones
    cuts = np.sort(rng.choice(np.arange(1, S - ones), rest - 1, replace=False)) if rest > 1 else np.zeros(0, int)
    lengths = [int(x) for x in np.diff(np.r_[0, cuts, S - ones])]
    for i in range(ones):
        lengths.insert(0 if i == 0 else len(lengths) if i == 1 else int(rng.integers(0, len(lengths) + 1)), 1)
    assert sum(lengths) == S and len(lengths) == n and min(lengths) >= 1
    return lengths


def make_batch(seed: int, first_rows: list[tuple[int, int]]):
    """positions [B, S] and bf16 q, k, v, do: rows of lo..hi documents; `first_rows` fixes the
    (documents, ones) of the first rows."""
    import torch
    a = ARGS
    rng = np.random.default_rng(seed)
    rows = []
    for b in range(a.batch):
        n, ones = first_rows[b] if b < len(first_rows) else (int(rng.integers(a.docs_lo, a.docs_hi + 1)),
                                                             int(rng.integers(1, 4)))
        rows.append(np.concatenate([np.arange(x) for x in row_lengths(rng, a.seq, n, min(ones, n))]))
    pos = np.stack(rows).astype(np.int64)
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = {n: torch.randn((a.batch, a.seq, h, a.head_dim), generator=g).to(torch.bfloat16).to(DEV)
         for n, h in (("q", a.heads), ("k", a.kv_heads), ("v", a.kv_heads), ("do", a.heads))}
    return pos, x


def reference(x: dict, pos: np.ndarray, scale: float) -> dict:
    """fp32 causal attention of each document alone (the bf16 inputs widened; TF32 off) and
    its gradients; lse [B, S, H] in natural log."""
    import torch
    q, k, v, do = (x[n] for n in ("q", "k", "v", "do"))
    B, S, H, _ = q.shape
    G = H // k.shape[2]
    out = {n: torch.zeros(x[src].shape, dtype=torch.float32, device=DEV)
           for n, src in (("o", "q"), ("dq", "q"), ("dk", "k"), ("dv", "v"))}
    out["lse"] = torch.zeros((B, S, H), dtype=torch.float32, device=DEV)
    for b in range(B):
        starts = sorted(set(np.flatnonzero(pos[b] == 0).tolist()) | {0}) + [S]
        for s, e in zip(starts[:-1], starts[1:]):
            L = e - s
            qd, kd, vd = (t[b, s:e].float().transpose(0, 1).detach().requires_grad_() for t in (q, k, v))
            kk, vv = kd.repeat_interleave(G, 0), vd.repeat_interleave(G, 0)
            sc = (qd @ kk.transpose(1, 2)) * scale
            sc = sc.masked_fill(~torch.ones(L, L, dtype=torch.bool, device=DEV).tril(), float("-inf"))
            lse = torch.logsumexp(sc, -1)
            od = torch.exp(sc - lse[..., None]) @ vv
            od.backward(do[b, s:e].float().transpose(0, 1))
            out["o"][b, s:e] = od.detach().transpose(0, 1)
            out["lse"][b, s:e] = lse.detach().transpose(0, 1)
            for n, t in (("dq", qd), ("dk", kd), ("dv", vd)):
                out[n][b, s:e] = t.grad.transpose(0, 1)
    return out


def compare(got, ref) -> dict:
    g, r = got.double().flatten(), ref.double().flatten()
    nan = int(g.isnan().sum())
    g = g.nan_to_num()
    err, top = float((g - r).abs().max()), float(r.abs().max())
    cos = float((g * r).sum() / (g.norm() * r.norm()).clamp_min(1e-300))
    return {"max_abs_err": err, "max_abs_ref": top, "rel_err": err / max(top, 1e-30), "cosine": cos, "nan": nan,
            "ok": nan == 0 and cos >= 0.999}


class Outputs:
    """o, lse, dq, dk, dv of one run: NaN where not written, 3.0 in a guard of S tokens past
    the B*S (empty sequences start there: nothing may be written)."""

    def __init__(self, lse_token_major: bool = True, extra_tokens: int = 0):
        import torch
        a = ARGS
        T = a.batch * a.seq + extra_tokens
        self.T = T
        self.flat, self.view = {}, {}
        for n, h, d, dt in (("o", a.heads, a.head_dim, torch.bfloat16), ("lse", a.heads, 1, torch.float32),
                            ("dq", a.heads, a.head_dim, torch.bfloat16), ("dk", a.kv_heads, a.head_dim, torch.bfloat16),
                            ("dv", a.kv_heads, a.head_dim, torch.bfloat16)):
            f = torch.full(((T + a.seq) * h * d,), 3.0, dtype=dt, device=DEV)
            f[:T * h * d] = float("nan")
            self.flat[n] = f
            self.view[n] = f[:T * h * d].view(T, h, d)

    def buffers(self) -> list:
        return [self.view[n] for n in ("o", "lse", "dq", "dk", "dv")]

    def guards_untouched(self) -> dict:
        return {n: bool((f[self.T * (f.numel() // (self.T + ARGS.seq)):] == 3.0).all()) for n, f in self.flat.items()}

    def checked(self, ref: dict, tokens: int) -> dict:
        """Each output's first `tokens` rows against the reference ([B, S, ...] flattened)."""
        res = {}
        for n in ("o", "dq", "dk", "dv"):
            res[n] = compare(self.view[n][:tokens], ref[n].reshape(tokens, *ref[n].shape[2:]))
        got = self.view["lse"][:tokens, :, 0]
        want = ref["lse"].reshape(tokens, -1)
        res["lse"] = compare(got, want)
        res["lse"]["ok"] = True  # informative: only cuDNN's backward reads it
        if res["lse"]["rel_err"] > 1e-3:  # log2 units?
            res["lse"]["rel_err_as_log2"] = compare(got, want * 1.4426950408889634)["rel_err"]
        res["guard_untouched"] = self.guards_untouched()
        res["ok"] = all(res[n]["ok"] for n in ("o", "dq", "dk", "dv")) and all(res["guard_untouched"].values())
        return res


# -- the stages ----------------------------------------------------------------------------
def st_env(ctx):
    import torch
    info = {"python": sys.version.split()[0], "torch": torch.__version__, "torch_cuda": torch.version.cuda,
            "device": DEV, "emulate": ARGS.emulate}
    if DEV == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
        info["capability"] = list(torch.cuda.get_device_capability(0))
        info["torch_cudnn"] = torch.backends.cudnn.version()
    if ARGS.emulate:
        sys.path.insert(0, str(REPO / "tests"))
        import _cudnn_emulator
        sys.modules["cudnn"] = _cudnn_emulator
    else:
        so = libcudnn()
        info["libcudnn"] = so
        if so:
            ctypes.CDLL(so, mode=ctypes.RTLD_GLOBAL)
    import cudnn
    info["cudnn_frontend"] = getattr(cudnn, "__version__", "?")
    info["cudnn_frontend_file"] = getattr(cudnn, "__file__", "?")
    info["cudnn_backend"] = cudnn.backend_version_string()
    att = import_attention()
    info["lorac_attention"] = att.__file__
    att._init()
    set_stream(att)
    ctx["att"] = att
    for k, v in info.items():
        print(f"  {k}: {v}")
    return info


def st_data(ctx):
    import torch
    torch.backends.cuda.matmul.allow_tf32 = False  # an fp32 reference
    torch.backends.cudnn.allow_tf32 = False
    a = ARGS
    first = [(a.docs_lo, 1), (a.docs_hi, 3), (max(a.docs_lo, min(12, a.docs_hi)), 2)]
    ctx["pos"], ctx["x"] = make_batch(a.seed, first)
    ctx["scale"] = a.head_dim ** -0.5
    ctx["ref"] = reference(ctx["x"], ctx["pos"], ctx["scale"])
    docs = (ctx["pos"] == 0).sum(1)
    info = {"B": a.batch, "S": a.seq, "H": a.heads, "K": a.kv_heads, "Dh": a.head_dim,
            "documents_per_row": docs.tolist(), "documents": int(docs.sum()),
            "length_1_documents": int(sum((np.diff(np.r_[np.flatnonzero(p == 0), a.seq]) == 1).sum() for p in ctx["pos"]))}
    print(f"  {info}")
    return info


def packed(ctx, name: str, capacity: int):
    """Build the packed plans for `capacity` sequences, run forward + backward, compare."""
    att, a = ctx["att"], ARGS
    B, S, H, K, Dh = a.batch, a.seq, a.heads, a.kv_heads, a.head_dim
    print(f"  building packed plans: {capacity} sequences", flush=True)
    docs = att._Documents(B, S, 1, empty, capacity=capacity)
    info = {"capacity": capacity}
    fwd = att._Plan(att.PACKED_FWD, B, S, H, K, Dh, ctx["scale"], docs)
    info["forward_plan"] = describe(fwd)
    bwd = att._Plan(att.PACKED_BWD, B, S, H, K, Dh, ctx["scale"], docs)
    info["backward_plan"] = describe(bwd)
    ensure_workspace(att, fwd, bwd)
    set_stream(att)
    docs.fill(ctx["pos"])
    out = Outputs()
    x = ctx["x"]
    o, lse, dq, dk, dv = out.buffers()
    fwd.run([x["q"], x["k"], x["v"], o, lse])
    sync()
    bwd.run([x["q"], x["k"], x["v"], o, x["do"], lse, dq, dk, dv])
    sync()
    info.update(out.checked(ctx["ref"], B * S))
    ctx[name] = (docs, fwd, bwd)
    show(info)
    return info


def describe(plan) -> dict:
    d = {"workspace_bytes": plan.workspace, "causal": str(plan.causal),
         "causal_spellings_failed": [f"{c}: {str(e).strip()[:500]}" for c, e in plan.failed]}
    g = plan.graph
    for how in (lambda: g.get_plan_name_at_index(getattr(g, "_plan_index", 0) or 0),
                lambda: g.selected_engine and g.selected_engine.name):
        try:
            d["engine"] = str(how())
            break
        except Exception:  # noqa: BLE001 - names differ between frontend versions
            pass
    return d


def show(info: dict) -> None:
    for n in ("o", "dq", "dk", "dv", "lse"):
        if n in info:
            r = info[n]
            print(f"  {n:3s} max|err| {r['max_abs_err']:.3e}  max|ref| {r['max_abs_ref']:.3e}  rel {r['rel_err']:.2e}  "
                  f"cos {r['cosine']:.6f}  nan {r['nan']}" + ("" if n == "lse" or r["ok"] else "  <-- FAIL"))
    if "guard_untouched" in info:
        print(f"  nothing written past the tokens: {info['guard_untouched']}")


def st_exact(ctx):
    return packed(ctx, "exact", int((ctx["pos"] == 0).sum()))


def st_padded(ctx):
    return packed(ctx, "padded", ARGS.batch * ARGS.docs_hi)


def st_replay(ctx):
    import torch
    if DEV != "cuda":
        return {"ok": True, "skipped": "no CUDA (emulated)"}
    att, a = ctx["att"], ARGS
    docs, fwd, bwd = ctx["padded"]
    x = {n: t.clone() for n, t in ctx["x"].items()}
    out = Outputs()
    o, lse, dq, dk, dv = out.buffers()
    sync()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        set_stream(att)  # the capture stream
        fwd.run([x["q"], x["k"], x["v"], o, lse])
        bwd.run([x["q"], x["k"], x["v"], o, x["do"], lse, dq, dk, dv])
    set_stream(att)
    info = {}
    batches = [("other", make_batch(a.seed + 1, [(1, 0), (a.docs_hi, 10), (a.docs_lo, 0)])),
               ("first again", (ctx["pos"], ctx["x"]))]
    for label, (pos, xs) in batches:
        for n in x:
            x[n].copy_(xs[n])
        for f in out.flat.values():
            f[:out.T * (f.numel() // (out.T + a.seq))] = float("nan")
        docs.fill(pos)
        graph.replay()
        sync()
        ref = ctx["ref"] if label == "first again" else reference(xs, pos, ctx["scale"])
        info[label] = out.checked(ref, a.batch * a.seq)
        info[label]["documents_per_row"] = (pos == 0).sum(1).tolist()
        print(f"  replay, {label} batch:")
        show(info[label])
    info["ok"] = all(info[k]["ok"] for k, _ in batches)
    return info


def timed(fn, iters: int) -> float:
    """Median milliseconds of fn over `iters` runs (after 3 warm-up runs)."""
    import torch
    for _ in range(3):
        fn()
    sync()
    times = []
    for _ in range(iters):
        if DEV == "cuda":
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def st_time(ctx):
    att, a = ctx["att"], ARGS
    B, S, H, K, Dh = a.batch, a.seq, a.heads, a.kv_heads, a.head_dim
    x = ctx["x"]
    out = Outputs()
    o, lse, dq, dk, dv = out.buffers()
    res = {}
    plain_f = att._Plan(att.FWD, B, S, H, K, Dh, ctx["scale"])
    plain_b = att._Plan(att.BWD, B, S, H, K, Dh, ctx["scale"])
    plans = {"plain": (plain_f, plain_b)}
    for name in ("exact", "padded"):
        if name in ctx:
            plans[name] = ctx[name][1:]
            ctx[name][0].fill(ctx["pos"])
    ensure_workspace(att, *(p for pair in plans.values() for p in pair))
    set_stream(att)
    for name, (f, b) in plans.items():
        res[name] = {"forward_ms": timed(lambda: f.run([x["q"], x["k"], x["v"], o, lse]), a.iters),
                     "backward_ms": timed(lambda: b.run([x["q"], x["k"], x["v"], o, x["do"], lse, dq, dk, dv]), a.iters)}
        r = res[name]
        r["fwd_plus_bwd_ms"] = r["forward_ms"] + r["backward_ms"]
        r["x28_layers_ms"] = 28 * r["fwd_plus_bwd_ms"]
    for name in ("exact", "padded"):
        if name in res:
            res[name]["vs_plain"] = res[name]["fwd_plus_bwd_ms"] / res["plain"]["fwd_plus_bwd_ms"]
    if "padded" in ctx:
        docs = ctx["padded"][0]

        def fill():
            docs.fill(ctx["pos"])
            sync()
        res["documents_fill_host_ms"] = timed(fill, a.iters)
    for k, v in res.items():
        print(f"  {k}: {v}")
    return res


def st_variants(ctx):
    """Alternatives, for when the runtime's path failed: what else cuDNN takes."""
    att, a = ctx["att"], ARGS
    B, S, H, K, Dh = a.batch, a.seq, a.heads, a.kv_heads, a.head_dim
    T, cap = B * S, B * a.docs_hi
    res = {}
    from lorac.runtime.devices.cuda.documents import split_documents
    lengths, starts = split_documents(ctx["pos"], cap)
    n = int((ctx["pos"] == 0).sum())

    def run_with(docs, fwd, bwd, lens, st, extra_tokens=0, outputs=None):
        docs.lengths.copyfrom(lens.astype(np.int32))
        for m, buf in docs.offsets.items():
            buf.copyfrom(st.astype(np.int64) * m)
        x = ctx["x"]
        if extra_tokens:  # inputs one token longer: the scratch token at T
            import torch
            x = {k: torch.cat([t.reshape(T, *t.shape[2:]), torch.zeros((extra_tokens, *t.shape[2:]), dtype=t.dtype,
                                                                         device=DEV)]) for k, t in x.items()}
        out = outputs or Outputs(extra_tokens=extra_tokens)
        o, lse, dq, dk, dv = out.buffers()
        set_stream(att)
        fwd.run([x["q"], x["k"], x["v"], o, lse])
        bwd.run([x["q"], x["k"], x["v"], o, x["do"], lse, dq, dk, dv])
        sync()
        return out.checked(ctx["ref"], T)

    def attempt(name, fn):
        try:
            res[name] = fn()
            show(res[name])
        except Exception as e:  # noqa: BLE001
            print(traceback.format_exc()[-2000:])
            res[name] = {"ok": False, "error": f"{type(e).__name__}: {str(e).strip()[:2000]}"}
        print(f"  variant {name}: {'ok' if res[name]['ok'] else 'FAILED'}", flush=True)

    def plans_for(capacity):
        if "padded" in ctx and capacity == cap:
            return ctx["padded"]
        docs = att._Documents(B, S, 1, empty, capacity=capacity)
        f = att._Plan(att.PACKED_FWD, B, S, H, K, Dh, ctx["scale"], docs)
        b = att._Plan(att.PACKED_BWD, B, S, H, K, Dh, ctx["scale"], docs)
        ensure_workspace(att, f, b)
        return docs, f, b

    def empty_at_start():
        st = starts.copy()
        st[n:] = 0
        return run_with(*plans_for(cap), lengths, st)

    def dummy_tokens():
        lens = lengths.copy()
        lens[n:] = 1
        st = starts.copy()
        st[n:] = T
        st[-1] = T + 1
        r = run_with(*plans_for(cap), lens, st, extra_tokens=1)
        r["note"] = "the scratch token's own outputs are not checked; guard starts past it"
        return r

    attempt("empty_sequences_start_at_0", empty_at_start)
    attempt("dummy_1_token_sequences_at_a_scratch_token", dummy_tokens)
    attempt("stats_padded_layout", lambda: padded_stats(ctx, n))
    res["ok"] = True  # informative
    return res


def padded_stats(ctx, capacity: int) -> dict:
    """The packed graphs with stats in the padded layout [N, H, S, 1] (no ragged offset), as
    the frontend's torch op feeds its backward on GPUs that refuse ragged stats; exact capacity."""
    import torch
    att, a = ctx["att"], ARGS
    c = att._cudnn
    B, S, H, K, Dh = a.batch, a.seq, a.heads, a.kv_heads, a.head_dim
    n, scale = capacity, ctx["scale"]
    docs = att._Documents(B, S, 1, empty, capacity=n)
    docs.fill(ctx["pos"])
    bf16, f32 = c.data_type.BFLOAT16, c.data_type.FLOAT

    def graph(kind):
        g = c.pygraph(io_data_type=bf16, intermediate_data_type=f32, compute_data_type=f32, handle=att._handle)
        t = lambda h, nm: g.tensor(*att._bshd(n, S, h, Dh), data_type=bf16, name=nm)  # noqa: E731
        q, k, v = t(H, "q"), t(K, "k"), t(K, "v")
        lens = [g.tensor([n, 1, 1, 1], [1, 1, 1, 1], data_type=c.data_type.INT32, name=f"len_{x}") for x in "qk"]
        rq = g.tensor([n + 1, 1, 1, 1], [1, 1, 1, 1], data_type=c.data_type.INT64, name="rq")
        rk = g.tensor([n + 1, 1, 1, 1], [1, 1, 1, 1], data_type=c.data_type.INT64, name="rk")
        q.set_ragged_offset(rq)
        k.set_ragged_offset(rk)
        v.set_ragged_offset(rk)
        mask = dict(use_causal_mask=True, use_padding_mask=True, seq_len_q=lens[0], seq_len_kv=lens[1])
        bound = {lens[0]: docs.lengths, lens[1]: docs.lengths, rq: docs.offsets_of(H * Dh), rk: docs.offsets_of(K * Dh)}
        if kind == "fwd":
            o, st = g.sdpa(q, k, v, attn_scale=scale, is_inference=False, name="sdpa", **mask)
            o.set_output(True).set_dim(att._bshd(n, S, H, Dh)[0]).set_stride(att._bshd(n, S, H, Dh)[1])
            o.set_ragged_offset(rq)
            st.set_output(True).set_data_type(f32).set_dim([n, H, S, 1]).set_stride([H * S, S, 1, 1])
            tensors = [q, k, v, o, st]
        else:
            o, do = t(H, "o"), t(H, "do")
            o.set_ragged_offset(rq)
            do.set_ragged_offset(rq)
            st = g.tensor([n, H, S, 1], [H * S, S, 1, 1], data_type=f32, name="stats")
            dq, dk, dv = g.sdpa_backward(q, k, v, o, do, st, attn_scale=scale, name="bwd", max_total_seq_len_q=att._round64(B * S),
                                         max_total_seq_len_kv=att._round64(B * S), **mask)
            for x, h, r in ((dq, H, rq), (dk, K, rk), (dv, K, rk)):
                x.set_output(True).set_dim(att._bshd(n, S, h, Dh)[0]).set_stride(att._bshd(n, S, h, Dh)[1])
                x.set_ragged_offset(r)
            tensors = [q, k, v, o, do, st, dq, dk, dv]
        g.build([c.heur_mode.A, c.heur_mode.FALLBACK])
        return g, tensors, {tt: b.data_ptr() for tt, b in bound.items()}

    plans = {kind: graph(kind) for kind in ("fwd", "bwd")}
    ws = max(int(g.get_workspace_size()) for g, _, _ in plans.values())
    wst = torch.empty(max(ws, 1), dtype=torch.uint8, device=DEV)
    stats = torch.full((n * H * S,), float("nan"), dtype=torch.float32, device=DEV)
    out = Outputs()
    o, _, dq, dk, dv = out.buffers()
    x = ctx["x"]
    set_stream(att)
    for kind, bufs in (("fwd", [x["q"], x["k"], x["v"], o, stats]),
                       ("bwd", [x["q"], x["k"], x["v"], o, x["do"], stats, dq, dk, dv])):
        g, tensors, bound = plans[kind]
        g.execute({**{tt: b.data_ptr() for tt, b in zip(tensors, bufs)}, **bound}, wst.data_ptr(), handle=att._handle)
        sync()
    r = out.checked(ctx["ref"], B * S)
    r["lse"] = {"note": "padded layout, not compared"}
    r["lse"].update(ok=True, max_abs_err=0, max_abs_ref=0, rel_err=0, cosine=1, nan=0)
    return r


def st_tvm(ctx):
    """prepare() + feeder() + the registered functions: the path a compiled step takes."""
    if ARGS.emulate:
        return {"ok": True, "skipped": "emulated"}
    try:
        import tvm  # noqa: F401
        import tvm_ffi
    except Exception as e:  # noqa: BLE001
        return {"ok": True, "skipped": f"TVM's runtime does not import here ({e}); source bench/h200_env.sh first"}
    from types import SimpleNamespace

    import torch
    from lorac.runtime.devices.cuda import loader
    att, a = ctx["att"], ARGS
    B, S, H, K, Dh = a.batch, a.seq, a.heads, a.kv_heads, a.head_dim
    loader._ensure_cuda_device_api()
    att.release()  # plans, documents, handle: prepare() starts afresh as an artifact's load does
    att.reserve_documents(a.docs_hi)
    calls = [{"function": fn, "B": B, "S": S, "H": H, "K": K, "Dh": Dh, "scale": ctx["scale"]}
             for fn in (att.PACKED_FWD, att.PACKED_BWD)]
    manifest = SimpleNamespace(unit_calls=calls)
    dev = tvm.cuda(0)
    att.prepare(manifest, dev)
    feed = att.feeder(manifest)
    x = ctx["x"]
    pos_t = torch.from_numpy(ctx["pos"]).to(DEV)
    feed({"position_ids": ctx["pos"]})
    out = Outputs()
    o, lse, dq, dk, dv = out.buffers()
    tv = tvm.runtime.from_dlpack
    sync()
    tvm_ffi.get_global_func(att.PACKED_FWD)(tv(x["q"]), tv(x["k"]), tv(x["v"]), tv(pos_t), tv(o.view(B, S, H, Dh)),
                                           tv(lse.view(B, S, H, 1)))
    tvm_ffi.get_global_func(att.PACKED_BWD)(tv(x["q"]), tv(x["k"]), tv(x["v"]), tv(o.view(B, S, H, Dh)),
                                           tv(x["do"]), tv(lse.view(B, S, H, 1)), tv(pos_t), tv(dq.view(B, S, H, Dh)),
                                           tv(dk.view(B, S, K, Dh)), tv(dv.view(B, S, K, Dh)))
    dev.sync()
    sync()
    info = out.checked(ctx["ref"], B * S)
    info["capacity"] = att._documents[(B, S)].capacity
    show(info)
    return info


def main(argv=None) -> int:
    global ARGS, DEV
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", help="write the report here (rewritten after each stage)")
    p.add_argument("--emulate", action="store_true", help="CPU, cuDNN's frontend emulated (tests/_cudnn_emulator.py)")
    p.add_argument("--variants", action="store_true", help="run the variants even when the runtime's path passed")
    p.add_argument("--batch", type=int)
    p.add_argument("--seq", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--kv-heads", type=int)
    p.add_argument("--head-dim", type=int)
    p.add_argument("--docs-lo", type=int, default=4)
    p.add_argument("--docs-hi", type=int, default=40)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    ARGS = p.parse_args(argv)
    small = dict(batch=2, seq=96, heads=4, kv_heads=2, head_dim=16)
    full = dict(batch=8, seq=1024, heads=16, kv_heads=8, head_dim=128)
    for k, v in (small if ARGS.emulate else full).items():
        if getattr(ARGS, k) is None:
            setattr(ARGS, k, v)
    if ARGS.emulate:
        ARGS.docs_hi, ARGS.iters = min(ARGS.docs_hi, 12), min(ARGS.iters, 2)
    DEV = "cpu" if ARGS.emulate else "cuda"
    REPORT["args"] = vars(ARGS)
    ctx: dict = {}
    if not stage("env", st_env, ctx)["ok"]:
        return 2
    if not stage("data", st_data, ctx)["ok"]:
        return 2
    exact, padded = stage("exact", st_exact, ctx), stage("padded", st_padded, ctx)
    replay = stage("replay", st_replay, ctx) if "padded" in ctx else {"ok": False}
    stage("time", st_time, ctx)
    if ARGS.variants or not (exact["ok"] and padded["ok"]):
        stage("variants", st_variants, ctx)
    stage("tvm", st_tvm, ctx)
    ok = exact["ok"] and padded["ok"] and replay["ok"]
    REPORT["ok"] = ok
    save()
    att = ctx.pop("att", None)
    ctx.clear()  # the plans built here go before the handle does, so the exit prints no nanobind leak report
    if att is not None:
        att.release()
    print("\n== summary: " + ", ".join(f"{k} {'ok' if v['ok'] else 'FAILED'}" for k, v in REPORT["stages"].items()))
    t = REPORT["stages"].get("time", {})
    if "plain" in t:
        print("   fwd+bwd ms: " + ", ".join(f"{k} {v['fwd_plus_bwd_ms']:.3f}" for k, v in t.items() if isinstance(v, dict)
                                        and "fwd_plus_bwd_ms" in v))
    return 0 if ok else 1


DEV = "cuda"

if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.exit(code)
