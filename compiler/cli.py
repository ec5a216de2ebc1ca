"""`lorac compile`: the command-line face of compile_graph (wired into `lorac` by the CLI)."""
from __future__ import annotations

import argparse
import sys

from .pipeline import DTYPES, FAMILIES

_EPILOG = """\
targets:
  cpu      this host's CPU (LLVM); GEMMs on OpenBLAS or MKL at run time
  aarch64  64-bit Arm Linux CPUs (LLVM cross build; needs gcc-aarch64-linux-gnu)
  cuda     NVIDIA sm_90 (H100/H200); DLight kernels, cuBLAS GEMMs, device code
           compiled here with nvcc and shipped in the artifact
  opencl   OpenCL GPUs, TVM's own kernels
  rocm     AMD GPUs (needs ROCm device libraries and ld.lld)
  vulkan   Vulkan GPUs (needs a TVM with Vulkan codegen; the apache-tvm wheel has none)
  metal    Apple GPUs (TVM 0.27's Metal codegen crashes; reported as an error)
  webgpu   browsers / wgpu, TVM's own kernels, 32-bit ids and indices

cpu, aarch64 and cuda artifacts run with the apache-tvm wheel's runtime (lorac
train); opencl, rocm and vulkan artifacts need a TVM runtime built with that
backend (no wheel has one), metal the macOS arm64 wheel, webgpu TVM's web runtime
(tvmjs). `lorac compile` says so in a note when it builds one (docs/TARGETS.md).

The artifact directory holds the compiled library and manifest.json (with the
sha256 of every file, checked before anything is loaded); rebuilding the same
graph for the same target and dtype is a cache hit (no work), and a directory
that fails that check is rebuilt.
examples:
  lorac compile train.onnx --target cpu --out art/cpu
  lorac compile train.onnx --target cuda --dtype bfloat16 --out art/cuda-bf16
  lorac compile train.onnx --target cuda --dtype bfloat16 --cuda-graph --out art/cuda-graph
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lorac compile", description="Compile a lorac ONNX training graph into a runnable artifact.",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("graph", metavar="GRAPH.onnx", help="training graph written by lorac.graphs")
    p.add_argument("--target", required=True, choices=FAMILIES, help="where the artifact will run")
    p.add_argument("--out", required=True, metavar="DIR", help="artifact directory (created, or replaced when it "
                   "is empty or an artifact; any other folder is refused)")
    p.add_argument("--dtype", default="float32", choices=DTYPES,
                   help="float32 (default), or bfloat16 frozen weights and GEMM inputs with "
                        "fp32 accumulation, LoRA tensors, loss and gradients (GPU targets)")
    p.add_argument("--tune", type=int, default=0, metavar="TRIALS",
                   help="MetaSchedule trials for the kernels TVM generates (cpu and cuda; 0 = "
                        "default schedules; cuda tunes on this machine's GPU and needs nvcc); a "
                        "tuned kernel is kept only where faster than its default; the database, "
                        "DIR/../.lorac-tuning/{cpu,cuda}-tuning.json, is reused by later compiles")
    p.add_argument("--cuda-graph", action="store_true",
                   help="cuda only: run the step as CUDA graphs captured on the first call (the "
                        "artifact's inputs are then copied into buffers of its own each call; "
                        "docs/COMPILER.md)")
    p.add_argument("--force", action="store_true", help="rebuild even when the artifact is up to date")
    p.add_argument("-q", "--quiet", action="store_true", help="print nothing on success")
    return p


def compile_command(argv: list[str], note=None) -> int:
    """Run `lorac compile ARGV`; `note(target)`: why this machine cannot run the artifact, or
    None (the runtime's CLI passes its devices' answer: the compiler knows no devices)."""
    args = build_parser().parse_args(argv)
    from lorac.core.artifact_cache import build_lock, check_output_dir
    from lorac.core.errors import LoracError

    from .pipeline import FAMILIES, compile_graph, target_module
    if args.cuda_graph and not hasattr(target_module(args.target), "binds_inputs"):  # the targets that capture graphs
        graphs = [f for f in FAMILIES if hasattr(target_module(f), "binds_inputs")]
        print(f"lorac compile: error: --cuda-graph is for --target {' or '.join(graphs)}, not {args.target}",
              file=sys.stderr)
        return 2
    target = {"kind": args.target, "cuda_graph": True} if args.cuda_graph else args.target
    try:
        check_output_dir(args.out)  # never over a folder lorac did not write
        with build_lock(args.out):  # one builder per artifact directory
            out = compile_graph(args.graph, target=target, out_dir=args.out, dtype=args.dtype,
                                tune=args.tune, force=args.force, verbose=not args.quiet)
    except LoracError as e:
        print(f"lorac compile: error: {e}", file=sys.stderr)
        return 2
    if not args.quiet:
        why = note(args.target) if note else None
        if why:  # it compiled, but this machine's runtime cannot run it
            print(f"lorac compile: note: target {args.target}: {why}", file=sys.stderr)
        print(out)
    return 0


if __name__ == "__main__":
    sys.exit(compile_command(sys.argv[1:]))
