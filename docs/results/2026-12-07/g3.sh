#!/usr/bin/env bash
# Session of 2026-12-07, the short call (~4 min) for when the device time left no longer fits g1.sh: the
# op graphs' GPU tests after the pool fix (f8d0448), then bench_train at 16,384 tokens with the graphs off
# and on, eager, compiled and in one whole-step CUDA graph (issue 31's rows).
set -uo pipefail
t0=$(date +%s)
source docs/results/2026-12-05/common.sh
echo "setup $(( $(date +%s) - t0 )) s"; nvidia-smi --query-gpu=name --format=csv,noheader
timeout 80 python3 -m pytest -q -p no:cacheprovider tests/kernels/training/test_train_graph.py > $OUT/gpu_tests_graph.txt 2>&1
echo "graph tests rc $? t $(( $(date +%s) - t0 )) s"; grep -E "passed|failed|^FAILED|^E " $OUT/gpu_tests_graph.txt | head -16
left=$(( ${TOTAL:-240} - ($(date +%s) - t0) ))
timeout $left python3 scripts/bench_train.py --tokens 16384 --d-ff 5632 --hot-units 1024 --variants fused3 \
  --op-graphs on off --twell-compile --cuda-graph --out $OUT/bench_train_16k.json > $OUT/bench_train_16k.txt 2>&1
echo "bench_train 16k rc $? t $(( $(date +%s) - t0 )) s"; grep -A30 "^all shapes" $OUT/bench_train_16k.txt | cut -c1-200; grep "replayed" $OUT/bench_train_16k.txt
echo "total $(( $(date +%s) - t0 )) s"
