#!/usr/bin/env bash
# Session of 2026-12-07, call 2 (at most ~9 min, every step time-limited): the
# 0.5b race, dense / sparse / sparse with train.twell_graphs=true; the op's GPU tests; bench_train at
# 65,536 tokens with the graphs on (issue 31's 3x row).
set -uo pipefail
t0=$(date +%s)
source docs/results/2026-12-05/common.sh
source docs/results/2026-12-06-b/race_ab.sh
echo "setup $(( $(date +%s) - t0 )) s"; nvidia-smi --query-gpu=name --format=csv,noheader
race_ab 0.5b $(( ${RACE_END:-260} - ($(date +%s) - t0) ))
echo "t $(( $(date +%s) - t0 )) s"
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/kernels/training/test_train.py > $OUT/gpu_tests_train.txt 2>&1
echo "op tests rc $? t $(( $(date +%s) - t0 )) s"; grep -E "passed|failed|^FAILED|^E " $OUT/gpu_tests_train.txt | head -8
left=$(( ${TOTAL:-540} - ($(date +%s) - t0) ))
timeout $left python3 scripts/bench_train.py --tokens 65536 --d-ff 5632 --hot-units 1024 --variants fused3 \
  --op-graphs on off --no-compile --cuda-graph --out $OUT/bench_train_64k.json > $OUT/bench_train_64k.txt 2>&1
echo "bench_train 64k rc $? t $(( $(date +%s) - t0 )) s"; grep -A16 "^all shapes" $OUT/bench_train_64k.txt | cut -c1-200
echo "total $(( $(date +%s) - t0 )) s"
