"""Check and time lorac CUDA artifacts on a GPU machine with TVM's runtime alone.

    python bench/h200_check.py reference ART_ROOT       # here: CPU fp32 reference outputs
    python bench/h200_check.py device ART_ROOT OUT_DIR  # on the GPU machine

ART_ROOT holds artifacts named <model>-<dtype>-<B>x<S>[-<target>] (see bench/prepare_h200.py).
Inputs come from a counter-based generator (splitmix64 in exact uint64 arithmetic), so
both machines build bit-identical inputs without shipping 160 MB of weights.
"""
from __future__ import annotations

import json
import sys
import time
import zlib
from pathlib import Path

import numpy as np


def _splitmix(n: int, seed: int) -> np.ndarray:
    """n uniforms in [0, 1), exact and identical on every platform."""
    z = np.arange(n, dtype=np.uint64) + np.uint64(seed * 0x9E3779B97F4A7C15 % 2**64)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) * 2.0**-53


def make_inputs(manifest: dict, exact: bool = True) -> dict[str, np.ndarray]:
    """Deterministic inputs for an artifact. exact=False tiles one random block (fast, for timing)."""
    vocab = next(i["shape"][0] for i in manifest["inputs"]
                 if i["name"].endswith(("embed_tokens.weight", "embeddings.weight")))  # decoder, Mamba
    block = _splitmix(1 << 20, 7) if not exact else None
    out = {}
    for spec in manifest["inputs"]:
        name, shape = spec["name"], spec["shape"]
        if "columns" in spec:  # a weight the step holds joined with LoRA B columns: its own width
            shape = shape[:-1] + [spec["columns"]]
        n = int(np.prod(shape)) if shape else 1
        seed = zlib.crc32(name.encode())
        u = _splitmix(n, seed) if exact or n <= block.size else np.resize(block, n)
        if spec["dtype"].startswith("int"):
            out[name] = (u * vocab).astype(np.int64).reshape(shape)
        elif "norm" in name:
            out[name] = (1.0 + 0.2 * (u - 0.5)).astype(np.float32).reshape(shape)
        else:
            out[name] = ((u - 0.5) * 0.07).astype(np.float32).reshape(shape)  # std ~0.02
    return out


def reference(art_root: Path) -> None:
    from lorac.runtime.engine.artifact import load_artifact
    for d in sorted(art_root.glob("*-float32-*-cpu")):
        step = load_artifact(d, "cpu")
        out = step(make_inputs(step.manifest.to_json()))
        np.savez(art_root / (d.name.removesuffix("-cpu") + ".ref.npz"), **out)
        print("reference", d.name, "loss", float(out["loss"]))


def device_inputs(step) -> tuple[dict, dict]:
    """(host inputs, the same uploaded to the step's device) for timing: tiled, not exact."""
    inputs = make_inputs(step.manifest.to_json(), exact=False)
    return inputs, {s["name"]: step.upload(s, inputs[s["name"]]) for s in step.inputs}


def time_step(step, args, n=10, warm=3) -> float:
    """Seconds per call of `step` on device inputs, after `warm` untimed calls."""
    for _ in range(warm):
        step(args, as_numpy=False)
    step._dev.sync()
    t = time.perf_counter()
    for _ in range(n):
        step(args, as_numpy=False)
    step._dev.sync()
    return (time.perf_counter() - t) / n


def device(art_root: Path, out_dir: Path) -> None:
    sys.modules["torch"] = None  # the runtime must not need torch
    import tvm
    import tvm_ffi

    from lorac.runtime.engine import gemm
    from lorac.runtime.engine.artifact import load_artifact
    print("tvm", tvm.__version__, "runtime-only:", not hasattr(tvm, "relax"), flush=True)
    results = []
    for d in sorted(p for p in art_root.iterdir() if p.is_dir() and not p.name.endswith("-cpu")):
        r = {"artifact": d.name}
        try:
            t = time.perf_counter()
            step = load_artifact(d, "cuda")
            r["load_s"] = round(time.perf_counter() - t, 3)
            ref_path = art_root / (d.name.replace("-bfloat16-", "-float32-").removesuffix("-graph") + ".ref.npz")
            if ref_path.is_file():  # numerics vs the CPU fp32 reference
                ref = dict(np.load(ref_path))
                if d.name.endswith("-graph"):  # capture on other inputs: check a replay
                    step(make_inputs(step.manifest.to_json(), exact=False))
                out = step(make_inputs(step.manifest.to_json()))
                r["loss"], r["ref_loss"] = float(out["loss"]), float(ref["loss"])
                r["loss_rel"] = abs(r["loss"] - r["ref_loss"]) / abs(r["ref_loss"])
                rel, cos = [], []
                for k, v in ref.items():
                    if k == "loss":
                        continue
                    g = out[k].astype(np.float64).ravel(); w = v.astype(np.float64).ravel()
                    rel.append(np.abs(g - w).max() / np.abs(w).max())
                    cos.append(g @ w / (np.linalg.norm(g) * np.linalg.norm(w)))
                r["grad_max_rel"], r["grad_min_cos"] = float(max(rel)), float(min(cos))
            _, args = device_inputs(step)
            r["step_ms"] = round(time_step(step, args) * 1e3, 3)
            # host side alone: how long 10 calls take to enqueue, before waiting for the GPU
            t = time.perf_counter()
            for _ in range(10):
                step(args, as_numpy=False)
            r["enqueue_ms"] = round((time.perf_counter() - t) * 1e2, 3)
            step._dev.sync()
            if d.name.endswith("-graph"):  # replays never call the GEMM functions again
                r["tokens"] = int(np.prod(step.manifest.inputs[0]["shape"]))
                r["tok_s"] = round(r["tokens"] / r["step_ms"] * 1e3)
                print(json.dumps(r), flush=True)
                results.append(r)
                continue
            # the same step with every GEMM a no-op: TVM's kernels + VM/host overhead
            for name in ("lorac.gemm_nn", "lorac.gemm_nt", "lorac.gemm_tn", "lorac.gemm_tt"):
                tvm_ffi.register_global_func(name, lambda a, b, o: None, override=True)
            r["no_gemm_ms"] = round(time_step(step, args) * 1e3, 3)
            gemm._registered = False
            gemm.register()
            r["gemm_ms"] = round(r["step_ms"] - r["no_gemm_ms"], 3)
            r["tokens"] = int(np.prod(step.manifest.inputs[0]["shape"]))
            r["tok_s"] = round(r["tokens"] / r["step_ms"] * 1e3)
            del step, args
        except Exception as e:  # report and go on with the next artifact
            r["error"] = f"{type(e).__name__}: {e}"[:800]
        print(json.dumps(r), flush=True)
        results.append(r)
    (out_dir / "lorac_h200.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    if sys.argv[1] == "reference":
        reference(Path(sys.argv[2]))
    else:
        device(Path(sys.argv[2]), Path(sys.argv[3]))
