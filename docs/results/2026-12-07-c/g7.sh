#!/usr/bin/env bash
source docs/results/2026-12-05/common.sh
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/kernels/training/test_train_graph.py > $OUT/gpu_tests_graph.txt 2>&1
echo "graph tests rc $?"; grep -E "passed|failed|^FAILED|^E " $OUT/gpu_tests_graph.txt | head -16
