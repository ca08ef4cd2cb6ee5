#!/usr/bin/env bash
# Session (f)'s plan, call 3 (at most ~4 min; after h1.sh and h2.sh if device time is left): issue 31's
# targets as bench_train measures them on this tree (16,384 and 65,536 tokens, d 2048 x 5632, paper-like
# inputs with their denser rows): TwELL against dense, eager, compiled and in one CUDA graph, with each
# row's host issue time. Issue 33's planner rows are session (b)'s c1.sh, a call of their own (~9 min).
set -uo pipefail
t0=$(date +%s)
source docs/results/2026-12-05/common.sh
timeout 200 python3 scripts/bench_train.py --tokens 16384 65536 --d-ff 5632 --hot-units 1024 --variants fused3 \
  --twell-compile --cuda-graph --out $OUT/bench_train.json > $OUT/bench_train.txt 2>&1
echo "bench_train rc $? t $(( $(date +%s) - t0 )) s"; tail -30 $OUT/bench_train.txt | cut -c1-260
echo "total $(( $(date +%s) - t0 )) s"
