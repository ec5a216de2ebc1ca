"""QLoRA and offload numerics on a GPU machine, with TVM's runtime alone (no compiler there).

    .venv/bin/python bench/h200_quant_check.py prepare ART_ROOT [KIND ...]   # here: compile, CPU references
    python3 bench/h200_quant_check.py device ART_ROOT             # GPU machine: one JSON line a check
    python3 bench/h200_quant_check.py bnb                         # GPU machine, torch + bitsandbytes:
                                                                  # bnb's dequantize_4bit vs lorac's reference

Checks, on a 40M-class Qwen3 shape at 4x256 (every projection quantized, LoRA on all seven):
- a dense bf16 base (gate and up held joined with their LoRA B columns), nf4 (double-quantized
  absmax), int8 and Q4_K bases: the bf16 CUDA step against the fp32 CPU
  step on the reference dequantization of the same blocks: loss within 1e-2 relative, every
  LoRA gradient's cosine >= 0.999 (the bars of docs/BENCHMARKS.md's numerics);
- checkpointing with and without offload, the latter of the inputs alone and of the inputs
  with the attention state (bf16, CUDA graphs): loss and gradients bit for bit, over three
  replays of the captured step;
- bitsandbytes' dequantize_4bit (CUDA, bf16 and fp32 outputs) against lorac's reference on the
  same blocks, bit for bit.
Inputs come from bench/h200_check.make_inputs (counter-based, identical on both machines);
quantized blocks are its uniforms as bytes.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from h200_check import _splitmix  # noqa: E402

SHAPE = dict(arch="qwen3", vocab=32000, hidden=512, layers=6, heads=8, kv_heads=4, head_dim=64, intermediate=1536,
             qk_norm=True)
B, S = 4, 256
# "dense": the bf16 base itself (its gate and up held joined with their LoRA B columns)
KINDS = {"dense": None, "nf4": dict(kind="nf4", block=64, double=True), "int8": dict(kind="int8"),
         "q4k": dict(kind="Q4_K")}


def _specs(kind: str | None, ckpt: bool = False, offload: bool = False, state: bool | None = None, mlp: int = 0):
    from lorac.graphs import ModelSpec, TrainSpec
    from lorac.graphs.families import for_spec
    from lorac.graphs.ops.quant import Quant
    spec = ModelSpec(**SHAPE)
    fam = for_spec(spec)
    quant = () if KINDS.get(kind) is None else tuple(sorted(
        (fam.weight_name(i, t), Quant(**KINDS[kind])) for i in range(spec.layers) for t in fam.TARGETS))
    train = TrainSpec(batch=B, seq=S, lora_targets=fam.TARGETS, rank=16, alpha=32.0, quant=quant,
                      checkpointing=ckpt, offload=offload, offload_state=state, keep_mlp=mlp)
    return spec, train


CKPT = {"plain": dict(), "offload": dict(offload=True, state=False), "offload-state": dict(offload=True, state=True),
        "offload-mlp": dict(offload=True, state=True, mlp=2)}  # two layers keep gate and up (TrainSpec.keep_mlp)


def inputs(manifest: dict) -> dict:
    """Deterministic inputs: floats as bench/h200_check.py makes them, quantized blocks and codes
    as bytes of the same uniforms, scales positive."""
    from h200_check import make_inputs
    import zlib
    plain = [i for i in manifest["inputs"] if ".weight." not in i["name"]]
    out = make_inputs({**manifest, "inputs": plain})
    for i in manifest["inputs"]:
        name, shape = i["name"], i["shape"]
        if ".weight." not in name:
            continue
        n = int(np.prod(shape))
        u = _splitmix(n, zlib.crc32(name.encode()))
        suffix = name.rsplit(".", 1)[1]
        if i["dtype"] in ("uint8", "int8"):
            out[name] = (u * 256).astype(np.uint8).view(i["dtype"]).reshape(shape)
            if suffix in ("Q4_K", "Q5_K", "Q6_K", "Q4_0", "Q4_1", "Q8_0"):  # keep the fp16 scales finite
                out[name] = _finite_gguf(out[name], suffix)
        elif suffix == "nf4_code":
            from lorac.runtime.model.quant.nf4 import NF4_CODE
            out[name] = np.asarray(NF4_CODE, np.float32).reshape(shape)
        elif suffix == "absmax_code":
            out[name] = np.sort((u * 2 - 1).astype(np.float32)).reshape(shape)
        elif suffix == "absmax_offset":
            out[name] = np.full(shape, 0.02, np.float32)
        else:  # absmax, absmax_scale, int8_scale
            out[name] = (0.01 + 0.02 * u).astype(np.float32).reshape(shape) / (127 if suffix == "int8_scale" else 1)
    return out


def _finite_gguf(raw: np.ndarray, kind: str) -> np.ndarray:
    """Random GGUF blocks with small finite fp16 scales (random bytes would make some inf/NaN);
    Q4_K's sub-block scales and mins are set so each sub-block is centred on zero (w = d (sc q - m)
    with m ~ 7.5 sc), as a real model's are: random ones make every weight positive and the
    step's gradients ill-conditioned, which a bf16-vs-fp32 comparison cannot judge."""
    from lorac.graphs.ops.quant import GGUF_BLOCKS
    _, nbytes = GGUF_BLOCKS[kind]
    blocks = raw.reshape(-1, nbytes).copy()
    halves = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (nbytes - 2,), "Q4_0": (0,), "Q4_1": (0, 2), "Q8_0": (0,)}[kind]
    scale = np.frombuffer(np.float16(0.0005 if kind == "Q4_K" else 0.001).tobytes(), np.uint8)
    for at in halves:
        blocks[:, at:at + 2] = scale
    if kind == "Q4_K":  # bytes 4..15: 6-bit (sc, m) of 8 sub-blocks, as gguf.quants' get_scale_min_k4 reads them
        sc = 1 + blocks[:, 16:24] % 8  # from the block's own random bytes: 1..8
        m = np.minimum(np.rint(7.5 * sc), 63).astype(np.uint8)
        sb = np.zeros((len(blocks), 12), np.uint8)
        sb[:, 0:4] = sc[:, 0:4]
        sb[:, 4:8] = m[:, 0:4] | ((m[:, 4:8] >> 4) << 6)
        sb[:, 8:12] = (sc[:, 4:8] & 15) | ((m[:, 4:8] & 15) << 4)
        blocks[:, 4:16] = sb
    return blocks.reshape(raw.shape)


def prepare(root: Path, only=None) -> None:
    from lorac.compiler import compile_graph
    from lorac.graphs import build_training_graph
    from lorac.runtime.engine.artifact import load_artifact
    from lorac.runtime.model.quant import dequantize_weights
    root.mkdir(parents=True, exist_ok=True)
    for kind in only or KINDS:
        spec, train = _specs(kind)
        art = compile_graph(build_training_graph(spec, train), target={"kind": "cuda", "cuda_graph": True},
                            out_dir=root / f"{kind}-cuda", dtype="bfloat16")
        feeds = inputs(json.loads((art / "manifest.json").read_text()))
        frozen = {k: v for k, v in feeds.items() if ".weight" in k and "lora_" not in k}
        dense = frozen if KINDS[kind] is None else dequantize_weights(frozen)
        spec, plain = _specs(None)
        ref = compile_graph(build_training_graph(spec, plain), target="cpu", out_dir=root / "dense-cpu", dtype="float32")
        rest = {k: v for k, v in feeds.items() if not (".weight" in k and "lora_" not in k)}
        out = load_artifact(ref, "cpu")({**rest, **dense})
        np.savez(root / f"{kind}.ref.npz", **out)
        print(kind, "reference loss", float(out["loss"]), flush=True)
    for name, how in CKPT.items() if only is None else ():
        spec, train = _specs(None, ckpt=True, **how)
        compile_graph(build_training_graph(spec, train), target={"kind": "cuda", "cuda_graph": True},
                      out_dir=root / f"ckpt-{name}-cuda", dtype="bfloat16")
        print("checkpointing", name, "compiled", flush=True)


def _cos(a, b) -> float:
    a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-30))


def device(root: Path) -> None:
    sys.modules["torch"] = None  # lorac's runtime needs no torch
    from lorac.runtime.engine.artifact import load_artifact
    for kind in KINDS:
        step = load_artifact(root / f"{kind}-cuda", "cuda")
        out = step(inputs(step.manifest.to_json()))
        ref = np.load(root / f"{kind}.ref.npz")
        grads = [k for k in ref.files if k != "loss"]
        cos = min(_cos(out[k], ref[k]) for k in grads)
        rel = abs(float(out["loss"]) - float(ref["loss"])) / abs(float(ref["loss"]))
        print(json.dumps({"check": f"{kind} bf16 cuda vs fp32 cpu", "loss_rel": rel, "min_grad_cosine": round(cos, 6),
                          "ok": rel <= 1e-2 and cos >= 0.999}), flush=True)
    runs = {}
    for name in CKPT:
        if not (root / f"ckpt-{name}-cuda").exists():  # an older ART_ROOT
            continue
        step = load_artifact(root / f"ckpt-{name}-cuda", "cuda")
        feeds = inputs(step.manifest.to_json())
        runs[name] = [step(feeds) for _ in range(3)]
    for name in list(runs)[1:]:
        same = all(np.array_equal(a[k], b[k]) for a, b in zip(runs["plain"], runs[name]) for k in a)
        print(json.dumps({"check": f"{name} vs plain checkpointing, 3 replays", "bit_identical": same, "ok": same,
                          "loss": float(runs[name][-1]["loss"])}), flush=True)


def bnb() -> None:
    """bitsandbytes' CUDA dequantize_4bit against lorac's reference, bit for bit."""
    import torch
    import bitsandbytes.functional as F
    from lorac.runtime.model.quant import nf4
    torch.manual_seed(0)
    for double in (False, True):
        for out_, in_ in ((1024, 4096), (4096, 1024), (96, 640)):
            for dt in (torch.float32, torch.bfloat16):  # bnb dequantizes into the weight's dtype
                w = torch.randn(out_, in_, device="cuda", dtype=dt)
                q, st = F.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=double)
                tensors = {f"w.{k}": v.cpu().numpy() for k, v in st.as_dict(packed=True).items()}
                tensors["w"] = q.cpu().numpy()
                arrays, shape = nf4.from_bnb(tensors, "w")
                mine = torch.from_numpy(nf4.dequantize(arrays, *shape)).to(dt)  # fp32 reference, rounded as bnb rounds
                same = bool(torch.equal(F.dequantize_4bit(q, st).cpu(), mine))
                print(json.dumps({"check": f"bnb dequantize_4bit {out_}x{in_} double={double} {dt}",
                                  "bit_identical": same, "ok": same}), flush=True)


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "prepare":  # prepare ROOT [KIND ...]
        prepare(Path(sys.argv[2]), sys.argv[3:] or None)
    elif mode == "device":
        device(Path(sys.argv[2]))
    else:
        bnb()
