#!/usr/bin/env bash
# Session 2026-12-05, call 2: issue 30's health question at 0.5b: 600 steps of 16k tokens at the peak LR
# 1e-3 from step 150 (constant after warm-up: the stress under which earlier runs' grad norm climbed),
# dense twin, sparse (1M-token dead window), a one-step window (the old re-init storm), no re-init.
set -uo pipefail
t0=$(date +%s)
source .gpu/common.sh
echo "setup $(( $(date +%s) - t0 )) s"
timeout 470 python3 scripts/race.py --out /tmp/health --settle 50 --only dense sparse window_one_step no_reinit \
  --variant no_reinit "sparsity.reinit_dead=false" --variant window_one_step "sparsity.dead_window_tokens=0" \
  -- experiment=paper_0.5b data=local train.global_batch_tokens=16384 train.micro_batch=8 train.seq_len=2048 \
  sparsity.l1_coef=1e-3 logging.log_interval=10 eval.interval=0 checkpoint.interval=0 checkpoint.save_final=false \
  optim.warmup_steps=150 optim.schedule=constant train.steps=600 > $OUT/health.txt 2>&1; echo "race rc $?"
tail -12 $OUT/health.txt
mkdir -p $OUT/health; cp /tmp/health/race.* /tmp/health/*.log $OUT/health/ 2>/dev/null
for r in /tmp/health/*/metrics.jsonl; do d=$(basename $(dirname $r)); mkdir -p $OUT/health/$d; cp $r $OUT/health/$d/; done
if [ ! -f /tmp/health/race.md ]; then  # the race was cut short: build the table from what finished
  python3 - <<'PY'
import json, pathlib
for p in sorted(pathlib.Path("/tmp/health").glob("*/metrics.jsonl")):
    rows = [json.loads(l) for l in p.read_text().splitlines() if l.startswith("{")]
    rows = [r for r in rows if "grad_norm" in r]
    print(p.parent.name, len(rows), [(r["step"], round(r["ce"], 3), round(r["grad_norm"], 2)) for r in rows[::7]])
PY
fi
tar -czf $OUT/health.tgz -C $OUT health && rm -rf $OUT/health
echo "total $(( $(date +%s) - t0 )) s"
