#!/usr/bin/env bash
# Session (e), call 4 (~6 min): the 1.5b race on this commit (both twins re-initialise by the kernel), and the
# sparse twin again on the host path before this session (variant before_host: TWELL_FAST_LAUNCH=0, the
# hot units' GEMMs on a side stream, TWELL_SIDE_STREAM=1; its override changes nothing) (issues 30, 31).
set -uo pipefail
t0=$(date +%s)
source docs/results/2026-12-05/common.sh
MODEL=${MODEL:-1.5b}
v=(--variant before_host "logging.log_interval=10")
common="experiment=paper_$MODEL $RACE_16K train.steps=100"
timeout ${LIMIT1:-330} python3 scripts/race.py --out /tmp/r$MODEL --settle 50 "${v[@]}" --only sparse dense -- $common > $OUT/race_$MODEL.txt 2>&1
echo "race $MODEL rc $? t $(( $(date +%s) - t0 )) s"
TWELL_FAST_LAUNCH=0 TWELL_SIDE_STREAM=1 timeout ${LIMIT2:-150} python3 scripts/race.py --out /tmp/r$MODEL --settle 50 "${v[@]}" --only before_host -- $common > $OUT/race_${MODEL}_before.txt 2>&1
echo "race $MODEL before_host rc $? t $(( $(date +%s) - t0 )) s"; tail -9 $OUT/race_${MODEL}_before.txt
tar -czf $OUT/race_$MODEL.tgz -C /tmp r$MODEL 2>/dev/null
echo "total $(( $(date +%s) - t0 )) s"
