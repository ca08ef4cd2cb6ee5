#!/usr/bin/env bash
# Session (b) of 2026-12-06, call 5 (what ~4 min of device time left allows): the per-layer graphs' GPU
# tests after the pool fix (f8d0448), the eager ones first, each bounded.
set -uo pipefail
t0=$(date +%s)
source docs/results/2026-12-05/common.sh
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 100 python3 -m pytest -q -p no:cacheprovider -k "not compiled" tests/kernels/training/test_train_graph.py > $OUT/gpu_tests_eager.txt 2>&1
echo "graph tests (eager) rc $? t $(( $(date +%s) - t0 )) s"; grep -E "passed|failed|^FAILED|^E " $OUT/gpu_tests_eager.txt | head -12
timeout 60 python3 -m pytest -q -p no:cacheprovider -k "compiled" tests/kernels/training/test_train_graph.py > $OUT/gpu_tests_compiled.txt 2>&1
echo "graph tests (compiled) rc $? t $(( $(date +%s) - t0 )) s"; grep -E "passed|failed|^FAILED|^E " $OUT/gpu_tests_compiled.txt | head -12
