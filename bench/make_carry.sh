#!/usr/bin/env bash
# Builds here what a GPU-machine call carries in .devcarry/ besides compiled caches (the GPU
# machine has no registry), each skipped where already made:
#   rt.tar.xz          TVM without its compiler (site/tvm) + the cp312 wheels of apache-tvm-ffi and
#                      nvidia-cudnn-frontend (bench/h200_env.sh unpacks it there)
#   peers.tar.xz       Unsloth, bitsandbytes (its CUDA 13.0 library alone), trl, datasets and the
#                      small packages they import, for the Unsloth / PEFT + bitsandbytes peers
#   peer_fast_gpu.py   the shared peer script (Unsloth, Liger), given as $1 (default
#                      ../shared/bench/peer_fast_gpu.py)
# Usage, from the repository root with the dev environment: bash bench/make_carry.sh [PEER_SCRIPT]
set -euo pipefail
D=.devcarry
PY=.venv/bin/python
mkdir -p $D
CP312=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64
       --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any)
wheel() {  # cp312 manylinux wheels of the named requirements into $1, no dependencies
  local dir=$1; shift
  $PY -m pip download -q "${CP312[@]}" -d "$dir" "$@"
}
if [ ! -f $D/rt.tar.xz ]; then
  rm -rf $D/rt && mkdir -p $D/rt/site $D/rt/whl
  tvm=$($PY -c 'import os, tvm; print(os.path.dirname(tvm.__file__))')
  ffi=$($PY -c 'import tvm_ffi; print(tvm_ffi.__version__)')
  cp -r "$tvm" $D/rt/site/tvm
  rm -rf $D/rt/site/tvm/lib/libtvm_compiler.so $D/rt/site/tvm/3rdparty
  find $D/rt/site/tvm -name __pycache__ -prune -exec rm -rf {} +
  wheel $D/rt/whl "apache-tvm-ffi==$ffi" "nvidia-cudnn-frontend>=1.32"
  tar -cJf $D/rt.tar.xz -C $D rt
  echo "rt.tar.xz: $(du -h $D/rt.tar.xz | cut -f1)"
fi
if [ ! -f $D/peers.tar.xz ]; then
  P=$(mktemp -d)
  wheel $P/whl unsloth unsloth_zoo bitsandbytes xformers tyro trl==1.15.0 "datasets<5" hf_transfer \
      cut_cross_entropy msgspec torchao json5 nest-asyncio structlog docstring_parser shtab typeguard dill \
      multiprocess pydantic pydantic_core annotated_types typing_inspection
  $PY -m pip install -q "${CP312[@]}" --no-compile --target $P/peers $P/whl/*.whl
  rm -rf $P/peers/studio $P/peers/diffusers $P/peers/bin
  find $P/peers/bitsandbytes -name 'libbitsandbytes_*' ! -name 'libbitsandbytes_cuda130.so' -delete
  find $P/peers -name __pycache__ -prune -exec rm -rf {} +
  tar -cJf $D/peers.tar.xz -C $P/peers .
  rm -rf "$P"
  echo "peers.tar.xz: $(du -h $D/peers.tar.xz | cut -f1)"
fi
cp "${1:-../shared/bench/peer_fast_gpu.py}" $D/peer_fast_gpu.py
