#!/usr/bin/env bash
# Set up the test environment and run the whole suite (GPU tests skip without a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh compile,test
exec .venv/bin/python -m pytest -q "$@"
