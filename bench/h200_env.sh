#!/usr/bin/env bash
# Source on the GPU machine, from the repo root: lorac importable with TVM's runtime alone (no
# libtvm_compiler, no torch in lorac's process) and cuDNN's Python frontend. Expects, built here:
#   .devcarry/rt/site/tvm   TVM minus libtvm_compiler.so and 3rdparty/ (bench/prepare_h200.py copies it)
#   .devcarry/rt/whl/       the cp312 wheels of apache-tvm-ffi and nvidia-cudnn-frontend
# (or both as .devcarry/rt.tar.xz, a third of the size: the transfer limit is 64 MiB a call)
# `source bench/h200_env.sh compiler`: the full TVM instead, to compile and tune there
# (bench/h200_tune.py); expects besides
#   .devcarry/tc/libtvm_compiler.so.xz   the wheel's compiler library (59 MB; its own transfer)
#   .devcarry/tc/whl/                    cp312 wheels of onnx, onnx-ir, ml_dtypes, protobuf
D=.devcarry
[ -d $D/rt ] || tar -xJf $D/rt.tar.xz -C $D
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $D/rt/whl/*.whl
mkdir -p /tmp/shim/lorac
for p in core graphs compiler runtime; do ln -sfn "$PWD/$p" /tmp/shim/lorac/$p; done
cp lorac_pkg/__init__.py /tmp/shim/lorac/
export PYTHONPATH=/tmp/shim:/tmp/site:$PWD/$D/rt/site TVM_USE_RUNTIME_LIB=1 PYTHONUNBUFFERED=1
if [ "${1:-}" = compiler ]; then
  [ -f $D/tc/libtvm_compiler.so ] || xz -dc $D/tc/libtvm_compiler.so.xz > $D/tc/libtvm_compiler.so
  ln -sfn "$PWD/$D/tc/libtvm_compiler.so" $D/rt/site/tvm/lib/libtvm_compiler.so
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site_c $D/tc/whl/*.whl
  export PYTHONPATH=/tmp/shim:/tmp/site_c:/tmp/site:$PWD/$D/rt/site
  unset TVM_USE_RUNTIME_LIB
  export PATH=$PATH:$(ls -d /usr/local/cuda*/bin 2>/dev/null | head -1)
fi
# the cuDNN frontend dlopens libcudnn.so.9 by name: the nvidia-cudnn-cu13 wheel's folder on the path
so=$(python3 -c 'import glob,site; print(*[g for p in site.getsitepackages() for g in glob.glob(p+"/nvidia/*/lib/libcudnn.so.9")][:1])')
[ -n "$so" ] && export LD_LIBRARY_PATH=$(dirname "$so"):${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
