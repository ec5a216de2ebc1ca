#!/usr/bin/env bash
# On the GPU machine (torch and nvcc there, no network): build the peer's mamba_ssm and
# causal_conv1d from their sdists, for sm_90 only, into /tmp/mssm-site, then print the
# PYTHONPATH line that makes `bench/peer_mamba.py BxS STEPS mamba_ssm` find them.
#   here:  .venv/bin/python -m pip download --no-deps --no-build-isolation --no-binary :all: \
#              mamba-ssm==2.3.2.post1 causal-conv1d==1.7.0 -d .devcarry/sdist
#          (MAMBA_SKIP_CUDA_BUILD=TRUE CAUSAL_CONV1D_SKIP_CUDA_BUILD=TRUE: metadata only)
#   there: bash bench/h200_build_mamba_ssm.sh [.devcarry/sdist]   (MAX_JOBS=16 by default)
# Their setup.py files compile for 8-9 GPU generations; only sm_90 is kept (the H200).
set -euo pipefail
SRC=${1:-.devcarry/sdist}
OUT=/tmp/mssm-site
WORK=/tmp/mssm-build
rm -rf "$WORK" && mkdir -p "$WORK" "$OUT"
for t in "$SRC"/causal_conv1d-*.tar.gz "$SRC"/mamba_ssm-*.tar.gz; do
  tar -xzf "$t" -C "$WORK"
done
for d in "$WORK"/causal_conv1d-*/ "$WORK"/mamba_ssm-*/; do
  python3 - "$d/setup.py" <<'PY'
import re, sys
p = sys.argv[1]
s = open(p).read()
s = re.sub(r'cc_flag\.append\("-gencode"\)\s*\n\s*cc_flag\.append\("arch=compute_(?!90,)\d+a?,code=sm_\d+a?"\)',
           "pass", s)
open(p, "w").write(s)
PY
  t0=$(date +%s)
  (cd "$d" && MAMBA_FORCE_BUILD=TRUE CAUSAL_CONV1D_FORCE_BUILD=TRUE MAX_JOBS=${MAX_JOBS:-16} \
     python3 -m pip install -q --no-build-isolation --no-deps --no-index --target "$OUT" .)
  echo "built $(basename "$d") in $(( $(date +%s) - t0 )) s"
done
echo "export PYTHONPATH=$OUT:\$PYTHONPATH"
