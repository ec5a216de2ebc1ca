"""Helpers of bench/cudnn_isolated_check.py (buffers, batches of packed documents, the fp32
reference per document, comparisons, timing). ARGS and DEV are set by the check's main()."""
from __future__ import annotations

import glob
import os
import shutil
import site
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
ARGS = None  # the check's parsed arguments
DEV = "cuda"  # torch's device: "cpu" with --emulate


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


def runtime_modules():
    """(lorac's cuDNN attention module, its documents module, its sdpa module)."""
    att = import_attention()
    from lorac.runtime.devices.cuda import documents, sdpa
    return att, documents, sdpa


def libcudnn() -> str | None:
    """The libcudnn.so.9 the frontend will load (loaded before it, globally): the first on
    LD_LIBRARY_PATH (bench/cudnn_newer_env.sh puts a newer cuDNN there), else the
    nvidia-cudnn-cu13 wheel's."""
    for d in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep):
        if d and os.path.exists(os.path.join(d, "libcudnn.so.9")):
            return os.path.join(d, "libcudnn.so.9")
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


def plan(ctx, backward: bool, layout: str = "causal", docs=None, group: int = 0, options=None, data=None):
    """A plan of lorac's runtime (runtime/devices/cuda/sdpa.py) at the check's shape."""
    att, a = ctx["att"], ARGS
    return ctx["sdpa"].Plan(att._cudnn, att._handle, backward, a.batch, a.seq, a.heads, a.kv_heads, a.head_dim,
                            ctx["scale"], layout, docs, group, options)


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


def make_batch(seed: int, first_rows: list[tuple[int, int]], lo: int | None = None, hi: int | None = None):
    """positions [B, S] and bf16 q, k, v, do: rows of lo..hi documents (default: --docs-lo,
    --docs-hi); `first_rows` fixes the (documents, ones) of the first rows."""
    import torch
    a = ARGS
    lo, hi = lo or a.docs_lo, hi or a.docs_hi
    rng = np.random.default_rng(seed)
    rows = []
    for b in range(a.batch):
        n, ones = first_rows[b] if b < len(first_rows) else (int(rng.integers(lo, hi + 1)), int(rng.integers(1, 4)))
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
