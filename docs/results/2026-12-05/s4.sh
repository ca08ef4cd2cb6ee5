#!/usr/bin/env bash
# Session 2026-12-05, call 4: the 1.5b race on this commit; then, time permitting, compiled + checkpointed
# 1.5b TwELL on torch 2.11 after the fix (plain checkpointing below torch 2.12.1): it runs, peak vs plan.
set -uo pipefail
t0=$(date +%s)
source .gpu/common.sh
echo "setup $(( $(date +%s) - t0 )) s"
timeout 230 python3 scripts/race.py --out /tmp/race15 --settle 50 -- experiment=paper_1.5b data=local train.global_batch_tokens=16384 \
  train.micro_batch=8 train.seq_len=2048 sparsity.l1_coef=1e-3 logging.log_interval=10 eval.interval=0 checkpoint.interval=0 \
  checkpoint.save_final=false optim.warmup_steps=20 train.steps=100 > $OUT/race15.txt 2>&1; echo "race rc $?"; tail -9 $OUT/race15.txt
echo "t $(( $(date +%s) - t0 )) s"
rem=$(( 285 - ($(date +%s) - t0) )); echo "bench_memory budget $rem s"
if [ $rem -gt 70 ]; then
timeout $rem python3 scripts/bench_memory.py --out /tmp/bmc2 --models 1.5b --ffn twell --checkpointing on --steps 3 -- train.compile=true > $OUT/bmc2.txt 2>&1; echo "bench_memory compiled ckpt rc $?"; head -3 $OUT/bmc2.txt
fi
tar -czf $OUT/r4.tgz -C /tmp race15 bmc2 2>/dev/null
echo "total $(( $(date +%s) - t0 )) s"
