#!/usr/bin/env bash
# Session 2026-12-05 (b), call 2 (not run: no device this session): the 1.5b race on this commit (issue 30's
# README row), then where a sparse 1.5b step's GPU idle time falls by the host's phase (issue 31:
# logging.profile_at's idle split: forward / backward / settle / optimizer / sparsity / data).
set -uo pipefail
t0=$(date +%s)
source docs/results/2026-12-05/common.sh
echo "setup $(( $(date +%s) - t0 )) s"
common="experiment=paper_1.5b $RACE_16K"
timeout 240 python3 scripts/race.py --out /tmp/race15 --settle 50 -- $common train.steps=100 > $OUT/race15.txt 2>&1; echo "race rc $?"; tail -9 $OUT/race15.txt
echo "t $(( $(date +%s) - t0 )) s"
timeout 150 python3 train.py $common run_dir=/tmp/p15s run_name=p15s train.steps=74 logging.profile_at=70 > $OUT/prof_sparse_log.txt 2>&1; echo "sparse profile rc $?"
grep -A20 "profile of steps" $OUT/prof_sparse_log.txt | head -24
cp /tmp/p15s/profile/*.txt $OUT/ 2>/dev/null
tar -czf $OUT/c2.tgz -C /tmp race15 2>/dev/null
echo "total $(( $(date +%s) - t0 )) s"
