#!/usr/bin/env bash
# Session 2026-12-05 (c), call 3: the 1.5b generation benchmark with this commit's defaults (issue 34's README
# row: batch 1 / 8 / 64), then a sparse 1.5b training run profiled after step 70 with the GPU's idle time
# split by the host's phase (issue 31).
set -uo pipefail
t0=$(date +%s)
source docs/results/2026-12-05/common.sh
echo "setup $(( $(date +%s) - t0 )) s"
timeout 250 python3 scripts/bench_generate.py --models 1.5b --batch 1 8 64 --new-tokens 64 --repeats 2 \
  --out $OUT/generate > $OUT/bench_generate.txt 2>&1; echo "bench_generate rc $?"; tail -8 $OUT/bench_generate.txt
echo "t $(( $(date +%s) - t0 )) s"
common="experiment=paper_1.5b $RACE_16K"
timeout 170 python3 train.py $common run_dir=/tmp/p15s run_name=p15s train.steps=74 logging.profile_at=70 > $OUT/prof_sparse_log.txt 2>&1; echo "sparse profile rc $?"
grep -E "^step|memory estimate|warmed" $OUT/prof_sparse_log.txt | cut -c1-300 | tail -6
grep -A24 "profile of steps" $OUT/prof_sparse_log.txt | head -30
cp /tmp/p15s/profile/*.txt $OUT/ 2>/dev/null
echo "total $(( $(date +%s) - t0 )) s"
