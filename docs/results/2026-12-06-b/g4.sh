#!/usr/bin/env bash
# Session (b) of 2026-12-06, call 4 (not run: no device time left; ~3.5 min): the graphs' GPU tests after the
# pool fix (call 2: a released memory pool captured into again, an allocator assert), the op's tests, and
# bench_train at 16,384 tokens with the graphs on and off (eager only).
set -uo pipefail
t0=$(date +%s)
source docs/results/2026-12-05/common.sh
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 80 python3 -m pytest -q -p no:cacheprovider tests/kernels/training/test_train_graph.py > $OUT/gpu_tests_graph.txt 2>&1
echo "graph tests rc $? t $(( $(date +%s) - t0 )) s"; grep -E "passed|failed|^FAILED|^E " $OUT/gpu_tests_graph.txt | head -16
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/kernels/training/test_train.py > $OUT/gpu_tests_train.txt 2>&1
echo "op tests rc $? t $(( $(date +%s) - t0 )) s"; grep -E "passed|failed|^FAILED|^E " $OUT/gpu_tests_train.txt | head -8
timeout 60 python3 scripts/bench_train.py --tokens 16384 --d-ff 5632 --hot-units 1024 --variants fused3 --rep 50 \
  --op-graphs off on --no-compile --out $OUT/bench_train_16k.json > $OUT/bench_train_16k.txt 2>&1
echo "bench rc $? t $(( $(date +%s) - t0 )) s"; grep -A12 "^all shapes" $OUT/bench_train_16k.txt | cut -c1-200; grep "replayed" $OUT/bench_train_16k.txt
echo "total $(( $(date +%s) - t0 )) s"
