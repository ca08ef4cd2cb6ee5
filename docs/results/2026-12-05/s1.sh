#!/usr/bin/env bash
# Session 2026-12-05, call 1: where the TwELL op's host time goes now (bench_train --profile at 16k),
# the generation GPU tests (TwELL case unverified) and time to first token with the dense prefill (34).
set -uo pipefail
t0=$(date +%s)
source .gpu/common.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
echo "setup $(( $(date +%s) - t0 )) s"
timeout 130 python3 scripts/bench_train.py --quick --hot-units 1024 --variants fused3 --sizes estimate \
  --profile --rep 30 --out $OUT/bench_train.json > $OUT/bench_train.txt 2>&1; echo "bench_train rc $?"
grep -A8 "host cost" $OUT/bench_train.txt | head -10
echo "t $(( $(date +%s) - t0 )) s"
timeout 140 python3 -m pytest -q -m gpu -p no:cacheprovider tests/model/test_generate.py > $OUT/gpu_tests.txt 2>&1; echo "gen tests rc $?"; tail -3 $OUT/gpu_tests.txt
echo "t $(( $(date +%s) - t0 )) s"
for pf in auto model; do
  timeout 100 python3 scripts/bench_generate.py --models 1.5b --batch 1 8 --new-tokens 64 --repeats 2 --prefill-ffn $pf --out $OUT/gen_$pf > $OUT/gen_$pf.txt 2>&1; echo "gen $pf rc $?"; tail -6 $OUT/gen_$pf.txt
  echo "t $(( $(date +%s) - t0 )) s"
done
echo "total $(( $(date +%s) - t0 )) s"
