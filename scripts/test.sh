#!/usr/bin/env bash
# The test command of the README: installs everything the tests need, then runs them.
# Kernels run through Triton's interpreter on CPU (tests/conftest.py sets TRITON_INTERPRET=1 when
# there is no CUDA); GPU-marked tests run only where CUDA is available.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh dev,eval
PY=${PYTHON:-python3}
exec "$PY" -m pytest -q "$@"
