#!/usr/bin/env bash
# Session (f)'s plan, call 1 (at most ~9.5 min on a fresh machine: every step has a time limit): the GPU
# tests of the kept-kernel launches and the training op on this tree (8edebfc and 8ad5ed2 changed
# kernels/_launch.py after the last GPU run), the op's host time split forward and backward (issue 31), then
# the 0.5b race three times over (issue 30: speed, and the CE gap against the dense twin's own spread).
set -uo pipefail
t0=$(date +%s)
source docs/results/2026-12-05/common.sh
echo "setup $(( $(date +%s) - t0 )) s"
tests=(tests/kernels/test_fast_launch.py tests/kernels/training/test_train.py tests/kernels/test_reinit.py)
timeout 150 python3 -m pytest -q -p no:cacheprovider "${tests[@]}" > $OUT/gpu_tests.txt 2>&1
echo "gpu tests rc $? t $(( $(date +%s) - t0 )) s"; grep -E "passed|failed|^FAILED|^E " $OUT/gpu_tests.txt | head -12
timeout 90 python3 docs/results/2026-12-05-f/host_split2.py $OUT/host_split2.json > $OUT/host_split2.txt 2>&1; echo "host split rc $?"
python3 -c "import json; r=json.load(open('$OUT/host_split2.json')); print({k: v for k, v in r.items() if not k.endswith('_ops')})" 2>&1 | head -20
echo "t $(( $(date +%s) - t0 )) s"
timeout ${LIMIT:-240} python3 scripts/race.py --out /tmp/r0.5b --settle 50 --repeats 3 -- experiment=paper_0.5b $RACE_16K train.steps=100 > $OUT/race_0.5b.txt 2>&1
rc=$?; echo "race 0.5b rc $rc t $(( $(date +%s) - t0 )) s"
# cut by the limit: the table of the runs that finished
[ $rc -eq 0 ] || python3 scripts/race.py --out /tmp/r0.5b --settle 50 --repeats 3 --no-run >> $OUT/race_0.5b.txt 2>&1
tail -16 $OUT/race_0.5b.txt
tar -czf $OUT/race_0.5b.tgz -C /tmp r0.5b 2>/dev/null
echo "total $(( $(date +%s) - t0 )) s"
