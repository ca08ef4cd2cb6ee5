# Sourced by this session's call scripts: the start every call shares (the environment of common.sh, the
# device's name), then graph_tests [SECONDS] [LINES]: the op graphs' GPU tests, time-limited, with the
# failures' lines. The calls ran these lines inline; they are gathered here as they were.
set -uo pipefail
t0=$(date +%s)
source docs/results/2026-12-05/common.sh
printf 'setup %s s\n' "$(( $(date +%s) - t0 ))"
nvidia-smi --query-gpu=name --format=csv,noheader
graph_tests() {
  local log=$OUT/gpu_tests_graph.txt
  timeout "${1:-80}" python3 -m pytest -q -p no:cacheprovider tests/kernels/training/test_train_graph.py > "$log" 2>&1
  printf 'graph tests rc %s t %s s\n' "$?" "$(( $(date +%s) - t0 ))"
  grep -E "passed|failed|^FAILED|^E " "$log" | head -"${2:-16}"
}
