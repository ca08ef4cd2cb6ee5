#!/usr/bin/env bash
# Installs twell and its dependencies into the current Python environment.
#   bash scripts/setup_env.sh            # runtime dependencies
#   bash scripts/setup_env.sh dev,eval   # plus test / evaluation extras
# torch and triton are pinned to a tested pair (2.13.0, 3.6.0) only when no torch is installed yet, so a machine
# that already has a CUDA build (e.g. a GPU image with torch 2.11) keeps it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
extras=${1:-}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  # The tested pair: torch 2.13.0 (the CPU build on CPU machines) and Triton 3.6.0, the Triton of our
  # GPU image, whose interpreter runs the kernels in the CPU tests.
  "$PY" -m pip install --quiet --disable-pip-version-check "torch==2.13.0" "triton==3.6.0"
fi
spec="."
[ -n "$extras" ] && spec=".[${extras}]"
"$PY" -m pip install --quiet --disable-pip-version-check -e "$spec"
