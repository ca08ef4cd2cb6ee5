#!/usr/bin/env bash
set -uo pipefail
t0=$(date +%s)
source docs/results/2026-12-05/common.sh
source docs/results/2026-12-06-b/race_ab.sh
echo "setup $(( $(date +%s) - t0 )) s"; nvidia-smi --query-gpu=name --format=csv,noheader
timeout 80 python3 -m pytest -q -p no:cacheprovider tests/kernels/training/test_train_graph.py > $OUT/gpu_tests_graph.txt 2>&1
echo "graph tests rc $? t $(( $(date +%s) - t0 )) s"; grep -E "passed|failed|^FAILED|^E " $OUT/gpu_tests_graph.txt | head -16
race_ab 0.5b 130
echo "t $(( $(date +%s) - t0 )) s"
race_ab 1.5b $(( 500 - ($(date +%s) - t0) ))
echo "total $(( $(date +%s) - t0 )) s"
