#!/usr/bin/env bash
# For the next session (not run yet), one call of ~420 s on one H200: (1) the 1.5b race with this commit's
# defaults, where the dense twin re-initialises by the kernel too (session (d) raced against a twin on PyTorch's
# re-init), with deferred entry-list sizes (no per-layer count read in the forward) as a third run; (2) a sparse
# 1.5b step profiled with deferred sizes, the GPU's idle time split by the host's phase (fixed in bf1991a), to
# set against session (d)'s 23 ms of forward idle with estimate sizes.
set -uo pipefail
t0=$(date +%s)
source docs/results/2026-12-05/common.sh
echo "setup $(( $(date +%s) - t0 )) s"
common="experiment=paper_1.5b $RACE_16K"
timeout 260 python3 scripts/race.py --out /tmp/race_f1 --settle 50 --variant deferred "train.twell_sizes=deferred" -- $common train.steps=100 > $OUT/race.txt 2>&1
echo "race rc $?"; tail -9 $OUT/race.txt
tar -czf $OUT/race.tgz -C /tmp race_f1 2>/dev/null
echo "t $(( $(date +%s) - t0 )) s"
timeout 140 python3 train.py $common run_dir=/tmp/pdef run_name=pdef train.twell_sizes=deferred train.steps=74 logging.profile_at=70 > $OUT/prof_deferred_log.txt 2>&1
echo "profile rc $?"; grep -A22 "profile of steps" $OUT/prof_deferred_log.txt | head -26
cp /tmp/pdef/profile/*.txt $OUT/ 2>/dev/null; gzip -c /tmp/pdef/profile/step_70.trace.json > $OUT/step_70_deferred.trace.json.gz 2>/dev/null
echo "total $(( $(date +%s) - t0 )) s"
