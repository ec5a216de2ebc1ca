#!/usr/bin/env bash
# QLoRA and offload measurements on the GPU machine (issue 26), one stage per argument, each
# under its own time limit so one slow stage cannot take the call's whole 10 minutes.
# Expects under .devcarry/, built here (each folder also accepted as FOLDER.tar.xz: compiled
# artifacts compress ~8x, so everything travels in one call):
#   rt.tar.xz              TVM without its compiler + cp312 wheels (bench/h200_env.sh)
#   peers.tar.xz, peer_fast_gpu.py   Unsloth and its wheels (docs/BENCHMARKS.md), shared/bench's peer
#   qcheck                 bench/h200_quant_check.py prepare .devcarry/qcheck
#   qcacheN                bench/h200_vs_peers.py prepare .devcarry/qcacheN CASE ...
# Stages: check[:DIR] (the quantized steps' numerics, artifacts in DIR, default qcheck),
# kernels:CACHE:CASE (every kernel of the case's step, bench/h200_kernels.py), CACHE:CASE[,CASE] (lorac + the case's peers),
# CACHE:CASE!  (lorac alone). Usage: bash bench/h200_qlora_session.sh check qcache6:8b-1x2048-nf4e-auto8 ...
set -u
D=.devcarry
for t in $D/*.tar.xz; do
  n=$(basename "$t" .tar.xz)
  case $n in rt|peers) continue ;; esac
  [ -d "$D/$n" ] || tar -xJf "$t" -C $D
done
source bench/h200_env.sh > /tmp/h200_env.log 2>&1; tail -n 1 /tmp/h200_env.log
if [ -f $D/peers.tar.xz ]; then
  mkdir -p /tmp/peers && [ -d /tmp/peers/unsloth ] || tar -xJf $D/peers.tar.xz -C /tmp/peers
  export PYTHONPATH=/tmp/peers:$PYTHONPATH HF_HUB_OFFLINE=1
  cp $D/peer_fast_gpu.py bench/
fi
quiet() { grep -v -i -E "warning|nanobind|^ *$"; }
for stage in "$@"; do
  echo "== $stage ($(date +%T))"
  case $stage in
    check|check:*) dir=qcheck; [ "$stage" = check ] || dir=${stage#check:}
          timeout 180 python3 bench/h200_quant_check.py device $D/$dir 2>&1 | quiet | tail -n 20 ;;
    kernels:*) c=${stage#kernels:}; case_=${c#*:}; c=${c%%:*}
          timeout 300 python3 bench/h200_kernels.py $D/$c $case_ 60 2>&1 | quiet | tail -n 70 ;;
    *:*!) c=${stage%%:*}; cases=${stage#*:}; cases=${cases%!}
          NO_PEERS=1 timeout 400 python3 bench/h200_vs_peers.py device $D/$c ${cases//,/ } 2>&1 | quiet | tail -n 30 ;;
    *:*) c=${stage%%:*}; cases=${stage#*:}
         PEER_FAST=peer_fast_gpu.py PEER_STEPS=5 PEER_WARM=2 PEER_TIMEOUT=240 \
           timeout 560 python3 bench/h200_vs_peers.py device $D/$c ${cases//,/ } 2>&1 | quiet | tail -n 40 ;;
  esac
done
