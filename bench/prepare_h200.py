"""Build everything one H200 run of bench/h200_check.py needs, into a carried folder.

    .venv/bin/python bench/prepare_h200.py .devrun-compiler [--only GLOB ...] [--no-runtime]

Writes: art/ (CUDA artifacts of the 40M Qwen3, Qwen3-0.6B and Mamba shapes, CPU fp32
artifacts and their reference outputs), site/tvm (TVM without its compiler library: what a
user's GPU machine would install), whl/ (the cp312 tvm-ffi wheel for the device's Python).
--only keeps the builds whose artifact name matches one of the globs.
"""
from __future__ import annotations

import argparse
import fnmatch
import shutil
import subprocess
import sys
import time
from pathlib import Path

import tvm  # noqa: F401 - only to locate the installed package

from lorac.compiler import compile_graph
from lorac.graphs import ALL_TARGETS, ModelSpec, TrainSpec, build_training_graph
from lorac.graphs.mamba import DEVICE_CHUNK
from lorac.graphs.mamba_spec import MAMBA_TARGETS

sys.path.insert(0, str(Path(__file__).parent))
from bench_mamba_cpu import MAMBA_130M  # noqa: E402

QWEN3_40M = dict(arch="qwen3", vocab=32000, hidden=512, layers=8, heads=8, kv_heads=4, head_dim=64,
                 intermediate=1408, qk_norm=True)
QWEN3_06B = dict(arch="qwen3", vocab=151936, hidden=1024, layers=28, heads=16, kv_heads=8, head_dim=128,
                 intermediate=3072, qk_norm=True, rope_theta=1e6)
MAMBA_ODD = dict(model_type="mamba", vocab_size=1000, hidden_size=40, state_size=16, num_hidden_layers=2, expand=2,
                 conv_kernel=4, tie_word_embeddings=True)
MAMBA_S8 = {**MAMBA_ODD, "hidden_size": 24, "state_size": 8}
BUILDS = [  # (name, model, B, S, dtype, target)
    ("40m", QWEN3_40M, 4, 256, "float32", "cpu"),
    ("40m", QWEN3_40M, 4, 256, "float32", "cuda"),
    ("40m", QWEN3_40M, 4, 256, "bfloat16", "cuda"),
    ("40m", QWEN3_40M, 8, 1024, "float32", "cuda"),
    ("40m", QWEN3_40M, 8, 1024, "bfloat16", "cuda"),
    ("q06", QWEN3_06B, 8, 1024, "bfloat16", "cuda"),
    ("q06", QWEN3_06B, 1, 512, "bfloat16", "cuda"),
    # the same through TVM's CUDA graphs
    ("40m", QWEN3_40M, 4, 256, "float32", "cuda-graph"),
    # checkpointed (lean layers: SwiGLU's backward unit also forms silu(gate) * up), against
    # the fp32 CPU step of the same graph
    ("40m-ckpt", QWEN3_40M, 4, 256, "float32", "cpu"),
    ("40m-ckpt", QWEN3_40M, 4, 256, "bfloat16", "cuda"),
    ("40m", QWEN3_40M, 8, 1024, "bfloat16", "cuda-graph"),
    ("q06", QWEN3_06B, 8, 1024, "bfloat16", "cuda-graph"),
    ("q06", QWEN3_06B, 1, 512, "bfloat16", "cuda-graph"),
    # Mamba: a 2-layer 130M-width slice (all four LoRA targets) checked against the CPU
    # artifact, and the whole 130M shape with checkpointing on the HF peer's PEFT targets
    ("m2", {**MAMBA_130M, "num_hidden_layers": 2}, 4, 256, "float32", "cpu"),
    ("m2", {**MAMBA_130M, "num_hidden_layers": 2}, 4, 256, "float32", "cuda"),
    ("m2", {**MAMBA_130M, "num_hidden_layers": 2}, 4, 256, "bfloat16", "cuda"),
    ("mamba130m-ckpt", MAMBA_130M, 8, 1024, "bfloat16", "cuda"),
    # the scan kernels at odd shapes (issue #13), checkpointed, scan chunk 16 (the CUDA default):
    # 80 channels (two warps and a half one), seq 37 (a partial last chunk), state 16; and 48
    # channels with state 8 (fewer sums than lanes in the warp reduction)
    ("modd-ckpt", MAMBA_ODD, 2, 37, "float32", "cpu"),
    ("modd-ckpt", MAMBA_ODD, 2, 37, "float32", "cuda"),
    ("modd-ckpt", MAMBA_ODD, 2, 37, "bfloat16", "cuda"),
    ("modd-ckpt", MAMBA_ODD, 2, 37, "bfloat16", "cuda-graph"),
    ("m8-ckpt", MAMBA_S8, 3, 50, "float32", "cpu"),
    ("m8-ckpt", MAMBA_S8, 3, 50, "float32", "cuda"),
    ("m8-ckpt", MAMBA_S8, 3, 50, "bfloat16", "cuda"),
]


def _graph(name: str, model: dict, B: int, S: int):
    extra = {}
    if model.get("model_type") == "mamba":
        targets = ("in_proj", "x_proj", "dt_proj") if name == "mamba130m-ckpt" else MAMBA_TARGETS
        spec = ModelSpec.from_hf_config(model)
        if name not in ("m2", "mamba130m-ckpt"):  # those keep the chunk of their earlier runs
            extra["scan_chunk"] = DEVICE_CHUNK["cuda"]
    else:
        targets, spec = tuple(ALL_TARGETS), ModelSpec(**model)
    train = TrainSpec(batch=B, seq=S, rank=16, alpha=32, lora_targets=targets, checkpointing=name.endswith("-ckpt"),
                      extra=extra)
    return build_training_graph(spec, train)


def main(root: Path, only: list[str], runtime: bool) -> None:
    art = root / "art"
    art.mkdir(parents=True, exist_ok=True)
    for name, model, B, S, dtype, target in BUILDS:
        suffix = {"cuda": "", "cuda-graph": "-graph"}.get(target, "-" + target)
        out = art / f"{name}-{dtype}-{B}x{S}{suffix}"
        if only and not any(fnmatch.fnmatch(out.name, pat) for pat in only):
            continue
        graph = _graph(name, model, B, S)
        request = {"kind": "cuda", "cuda_graph": True} if target == "cuda-graph" else target
        t = time.perf_counter()
        compile_graph(graph, target=request, out_dir=out, dtype=dtype)
        print(f"{out.name}: {time.perf_counter() - t:.1f} s", flush=True)
    subprocess.run([sys.executable, str(Path(__file__).with_name("h200_check.py")), "reference", str(art)], check=True)
    if not runtime:
        return

    # TVM as a GPU machine would have it: no libtvm_compiler.so, no 3rdparty headers
    src = Path(tvm.__file__).parent
    dst = root / "site" / "tvm"
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("libtvm_compiler.so", "3rdparty", "__pycache__", "*.pyc"))
    whl = root / "whl"
    if not list(whl.glob("apache_tvm_ffi-*.whl")):
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                        "--python-version", "3.12", "--implementation", "cp", "--platform", "manylinux_2_28_x86_64",
                        "-d", str(whl), "apache-tvm-ffi==0.1.15.post2"], check=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", type=Path)
    ap.add_argument("--only", nargs="*", default=[], metavar="GLOB")
    ap.add_argument("--no-runtime", dest="runtime", action="store_false", help="skip copying TVM's runtime")
    args = ap.parse_args()
    main(args.root, args.only, args.runtime)
