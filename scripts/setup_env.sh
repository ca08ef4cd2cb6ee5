#!/usr/bin/env bash
# Installs twell and its dependencies into the current Python environment.
#   bash scripts/setup_env.sh            # runtime dependencies
#   bash scripts/setup_env.sh dev,eval   # plus test / evaluation extras
# torch is pinned to the tested release (2.13.0) only when no torch is installed yet, so a machine that
# already has a CUDA build (e.g. a GPU image with torch 2.11) keeps it. Triton: the one torch brings (its
# Linux CUDA build needs its own, 3.7.1 for torch 2.13.0); a torch without one (the CPU build) gets Triton
# 3.6.0, the Triton of our GPU image, whose interpreter runs the kernels in the CPU tests.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
extras=${1:-}
pip_install() { "$PY" -m pip install --quiet --disable-pip-version-check "$@"; }
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  pip_install "torch==2.13.0"
fi
if ! "$PY" -c "import triton" >/dev/null 2>&1; then
  pip_install "triton==3.6.0"
fi
spec="."
[ -n "$extras" ] && spec=".[${extras}]"
pip_install -e "$spec"
