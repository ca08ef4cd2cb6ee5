#!/usr/bin/env bash
# Session 2026-12-05 (b), call 1: the planner's compiled model against compiled trainer steps (33; every
# row, checkpointing off and on, which also runs compiled + checkpointed TwELL on torch 2.11: 31), and the
# host cost of one launch on the H200 host (31).
set -uo pipefail
t0=$(date +%s)
source docs/results/2026-12-05/common.sh
echo "setup $(( $(date +%s) - t0 )) s"
timeout 40 python3 docs/results/2026-12-05-b/launch_probe.py $OUT/launch_probe.json > $OUT/launch_probe.txt 2>&1; echo "launch probe rc $?"; cat $OUT/launch_probe.txt | tail -14
echo "t $(( $(date +%s) - t0 )) s"
timeout 330 python3 scripts/bench_memory.py --out /tmp/bmc --compile --steps 3 > $OUT/bmc.txt 2>&1; echo "bench_memory compiled rc $?"; cat $OUT/bmc.txt | cut -c1-300
cp /tmp/bmc/bench_memory.md /tmp/bmc/bench_memory.json $OUT/ 2>/dev/null
# The paper recipe as launched (1M-token steps: 64 micro-batches, gradients held between them): the start-up
# estimate and auto's choice, then the measured peak of two steps, against an 80 GiB GPU's 72 GiB budget.
timeout 150 python3 train.py experiment=paper_1.5b data=local train.steps=2 logging.log_interval=1 eval.interval=0 \
  checkpoint.interval=0 checkpoint.save_final=false run_dir=/tmp/p15 > $OUT/paper15.txt 2>&1; echo "paper_1.5b rc $?"
grep -E "memory estimate|activation checkpointing|^step" $OUT/paper15.txt | cut -c1-400
tar -czf $OUT/bmc.tgz -C /tmp bmc 2>/dev/null
echo "total $(( $(date +%s) - t0 )) s"
