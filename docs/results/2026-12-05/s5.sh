#!/usr/bin/env bash
# Session 2026-12-05, call 4: compiled + checkpointed 1.5b TwELL on torch 2.11 after the fix (plain
# checkpointing below torch 2.12.1; it crashed in call 3): it runs, peak vs plan, step time.
set -uo pipefail
t0=$(date +%s)
source .gpu/common.sh
echo "setup $(( $(date +%s) - t0 )) s"
timeout 150 python3 scripts/bench_memory.py --out /tmp/bmc2 --models 1.5b --ffn twell --checkpointing on --steps 4 -- train.compile=true > $OUT/bmc2.txt 2>&1; echo "bench_memory compiled ckpt rc $?"; head -4 $OUT/bmc2.txt
grep -h '"step"' /tmp/bmc2/*/metrics.jsonl 2>/dev/null | tail -2 | cut -c1-260
tar -czf $OUT/r5.tgz -C /tmp bmc2 2>/dev/null
echo "total $(( $(date +%s) - t0 )) s"
