#!/usr/bin/env bash
# One GPU-machine session, run from the repo root with runtime-only TVM (no compiler, no torch
# in lorac's process). Expects, under .devcarry/ (compiled and split on the dev box):
#   site/ + shim/  (installed by the first call: TVM minus its compiler, tvm-ffi, gguf; lorac shim)
#   p1/ p2/        the SmolLM2-135M-Instruct GGUF in two parts (the transfer limit is 64 MiB a call)
#   cache/         `lorac train --target cuda --compile-only` artifacts (default run and 8x1024)
#   mart/          Mamba artifacts (bench/h200_check.py layout)
# Usage: bash bench/h200_session.sh OUT_DIR
set -u
D=.devcarry
OUT=$1
export PYTHONPATH=$PWD/$D/shim:$PWD/$D/site TVM_USE_RUNTIME_LIB=1 PYTHONUNBUFFERED=1
lorac() { python3 -c 'import sys; sys.modules["torch"] = None; from lorac.runtime.cli import main; sys.exit(main(sys.argv[1:]))' "$@"; }
cat $D/p1/gguf.part $D/p2/gguf.part > $D/smollm2.gguf
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
echo "== lorac train (the default run) --target cuda"
lorac train --model $D/smollm2.gguf --target cuda --cache-dir $D/cache --out $OUT/default 2>&1 | grep -v Warning > $OUT/default.log
grep -E "compil|^eval|^step +(1|10|20|30|40)/|sample|^> |^[A-Za-z]" $OUT/default.log | grep -v '^ "' | head -60
echo "== lorac train --target cuda, SmolLM2 8x1024, 12 steps"
lorac train --model $D/smollm2.gguf --target cuda --cache-dir $D/cache --out $OUT/b8 --batch 8 --seq 1024 --steps 12 \
    --eval-batches 0 --sample-tokens 0 2>&1 | grep -E "^step|compil|error" | tail -n 13
if [ -d $D/mart ]; then
  echo "== Mamba artifacts (numerics vs the CPU fp32 artifact, step times)"
  python3 bench/h200_check.py device $D/mart $OUT 2>&1 | tail -n 6
fi
echo "== peers"
for s in 4x128 8x1024; do python3 bench/peer_lora_gpu.py smollm2-135m $s eager compile; done 2>&1 | grep -v Warning | tail -n 6
[ -d $D/mart ] && timeout 240 python3 bench/peer_mamba.py 8x1024 1 2>&1 | tail -n 2
