#!/usr/bin/env bash
# Builds here a newer cuDNN than the GPU machine's for one device call (its nvidia-cudnn-cu13
# wheel is 517 MB; a call carries 64 MiB): only what fused attention loads, xz'd, in
# .devcarry/cudnnVER/ (libcudnn.so.9, libcudnn_graph.so.9, libcudnn_engines_runtime_compiled.so.9:
# ~55 MB), and cuDNN's Python frontend as .devcarry/fe.tar.xz (its cp312 wheel unpacked: 5.9 MB
# against the wheel's 11.6). The heuristics library is left out (the plans come from
# heur_mode.A/FALLBACK without it, or cuDNN says it is missing); so are the convolution,
# matmul and precompiled engines. bench/cudnn_newer_env.sh sets them up there.
# Usage, from the repository root with the dev environment: bash bench/cudnn_newer_carry.sh [VERSION]
set -euo pipefail
VER=${1:-9.28.1.4}
D=.devcarry
OUT=$D/cudnn${VER//./}
PY=.venv/bin/python
CP312=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
       --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64)
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
$PY -m pip download -q "${CP312[@]}" -d "$T" "nvidia-cudnn-cu13==$VER"
(cd "$T" && unzip -q nvidia_cudnn_cu13-*.whl 'nvidia/cudnn/lib/*')
mkdir -p "$OUT"
for f in libcudnn.so.9 libcudnn_graph.so.9 libcudnn_engines_runtime_compiled.so.9; do
  xz -T2 --lzma2=preset=9e,dict=256MiB -c "$T/nvidia/cudnn/lib/$f" > "$OUT/$f.xz"
done
if [ ! -f $D/fe.tar.xz ]; then
  $PY -m pip download -q "${CP312[@]}" -d "$T/fe" "nvidia-cudnn-frontend>=1.32"
  (cd "$T/fe" && unzip -q nvidia_cudnn_frontend-*.whl && rm nvidia_cudnn_frontend-*.whl)
  find "$T/fe" -name __pycache__ -prune -exec rm -rf {} +
  tar -cf - -C "$T/fe" . | xz -T2 -9 > $D/fe.tar.xz
fi
du -cb "$OUT"/*.xz $D/fe.tar.xz | tail -n 1 | awk '{printf "carry: %.1f MB (the limit: 67.1 MB with the work tree)\n", $1 / 1e6}'
