#!/usr/bin/env bash
# Session 2026-12-05 (c), call 2: a sparse 1.5b run profiled after step 70, the GPU's idle time split by the
# host's phase (issue 31), then the 1.5b race on this commit (issue 30) as far as the call allows.
set -uo pipefail
t0=$(date +%s)
source docs/results/2026-12-05/common.sh
echo "setup $(( $(date +%s) - t0 )) s"
common="experiment=paper_1.5b data=local train.global_batch_tokens=16384 train.micro_batch=8 train.seq_len=2048 sparsity.l1_coef=1e-3 logging.log_interval=10 eval.interval=0 checkpoint.interval=0 checkpoint.save_final=false optim.warmup_steps=20"
timeout 170 python3 train.py $common run_dir=/tmp/p15s run_name=p15s train.steps=74 logging.profile_at=70 > $OUT/prof_sparse_log.txt 2>&1; echo "sparse profile rc $?"
grep -E "^step|memory estimate|warmed" $OUT/prof_sparse_log.txt | cut -c1-300 | tail -6
grep -A24 "profile of steps" $OUT/prof_sparse_log.txt | head -30
cp /tmp/p15s/profile/*.txt $OUT/ 2>/dev/null
echo "t $(( $(date +%s) - t0 )) s"
timeout 330 python3 scripts/race.py --out /tmp/race15 --settle 50 -- $common train.steps=100 > $OUT/race15.txt 2>&1; echo "race rc $?"; tail -9 $OUT/race15.txt
tar -czf $OUT/race15.tgz -C /tmp race15 2>/dev/null
echo "total $(( $(date +%s) - t0 )) s"
