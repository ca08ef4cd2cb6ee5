#!/usr/bin/env bash
# The test command of the README: installs everything the tests need, then runs them.
#   bash scripts/test.sh [pytest args]                  # into the current Python environment
#   bash scripts/test.sh --triton-latest [pytest args]  # kernel + model tests under the newest Triton
# Kernels run through Triton's interpreter on CPU (tests/conftest.py sets TRITON_INTERPRET=1 when
# there is no CUDA); GPU-marked tests run only where CUDA is available.
# --triton-latest builds its own virtual environment (.venv-triton-latest, or $TWELL_LATEST_VENV) with
# the current torch and the newest Triton release, so the environment you work in keeps the tested pair.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ "${1:-}" = "--triton-latest" ]; then
  shift
  venv=${TWELL_LATEST_VENV:-.venv-triton-latest}
  torch_pin=$("$PY" -c "import torch; print(torch.__version__.split('+')[0])" 2>/dev/null || echo 2.13.0)
  [ -x "$venv/bin/python" ] || "$PY" -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "torch==$torch_pin"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade triton
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -e ".[dev,eval]"
  "$venv/bin/python" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  exec "$venv/bin/python" -m pytest -q tests/kernels tests/model tests/eval/test_activity.py tests/test_namespace.py "$@"
fi
bash scripts/setup_env.sh dev,eval
exec "$PY" -m pytest -q "$@"
