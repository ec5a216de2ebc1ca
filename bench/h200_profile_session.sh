#!/usr/bin/env bash
# One GPU-machine call for the step breakdowns (runtime-only TVM, no torch in lorac's process).
# Expects under .devcarry/ (built on the dev box): rt/site (TVM without its compiler), rt/whl
# (the cp312 tvm-ffi wheel); ART (bench/prepare_h200.py ROOT --only 'm2-*' 'q06-bfloat16-8x1024'
# '40m-bfloat16-8x1024' '40m-float32-4x256*': ROOT/art) and MART (--only 'mamba130m-ckpt-*').
# Usage: bash bench/h200_profile_session.sh OUT_DIR ART MART
set -u
D=.devcarry
OUT=$1
ART=$2
MART=$3
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $D/rt/whl/apache_tvm_ffi-*.whl
mkdir -p /tmp/shim/lorac
for p in core graphs compiler runtime; do ln -sfn "$PWD/$p" /tmp/shim/lorac/$p; done
cp lorac_pkg/__init__.py /tmp/shim/lorac/
export PYTHONPATH=/tmp/shim:/tmp/site:$PWD/$D/rt/site TVM_USE_RUNTIME_LIB=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
echo "== numerics vs the CPU fp32 artifact, step times (bench/h200_check.py)"
python3 bench/h200_check.py device $ART $OUT 2>&1 | grep -v Warning
echo "== where the step's time goes (bench/h200_profile.py)"
python3 bench/h200_profile.py $ART/q06-bfloat16-8x1024 $ART/40m-bfloat16-8x1024 \
    $ART/m2-bfloat16-4x256 $ART/m2-float32-4x256 2>&1 | grep -v Warning
echo "== Mamba-130M shape 8x1024, bf16, checkpointing"
timeout 300 python3 bench/h200_quick_step.py $MART/mamba130m-ckpt-bfloat16-8x1024 2 2>&1 | grep -v Warning
nvidia-smi --query-gpu=memory.used --format=csv,noheader
