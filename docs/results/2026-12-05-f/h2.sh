#!/usr/bin/env bash
# Session (f)'s plan, call 2 (~7 min on a warm machine): the 1.5b race with every twin run three times
# (issue 30's +35% and the CE gap against the dense twin's spread). LIMIT bounds it inside the call.
set -uo pipefail
t0=$(date +%s)
source docs/results/2026-12-05/common.sh
timeout ${LIMIT:-500} python3 scripts/race.py --out /tmp/r1.5b --settle 50 --repeats ${REPEATS:-3} -- experiment=paper_1.5b $RACE_16K train.steps=100 > $OUT/race_1.5b.txt 2>&1
rc=$?; echo "race 1.5b rc $rc t $(( $(date +%s) - t0 )) s"
# cut by the limit: the table of the runs that finished
[ $rc -eq 0 ] || python3 scripts/race.py --out /tmp/r1.5b --settle 50 --repeats ${REPEATS:-3} --no-run >> $OUT/race_1.5b.txt 2>&1
tail -16 $OUT/race_1.5b.txt
tar -czf $OUT/race_1.5b.tgz -C /tmp r1.5b 2>/dev/null
echo "total $(( $(date +%s) - t0 )) s"
