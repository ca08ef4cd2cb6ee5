#!/usr/bin/env bash
# The main job of the README: install, build the offline sample data and tokenizer, and train a
# small model on it (CPU, or the GPU if there is one). Extra arguments are Hydra overrides.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
PY=${PYTHON:-python3}
"$PY" scripts/prepare_offline_data.py
exec "$PY" train.py experiment=quickstart "$@"
