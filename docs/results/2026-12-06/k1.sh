#!/usr/bin/env bash
# Session of 2026-12-06, call 1 (at most ~9.3 min: every step has a time limit). The GPU tests of the
# kept-kernel launches, the training op and the re-init kernel on this tree (kernels/_launch.py changed
# after the last GPU run); the op's host time split forward and backward (issue 31); then the 1.5b race,
# each twin twice (issue 30: speed, CE gap against the dense twins' own spread), under this tree's
# re-init rule (a re-drawn gate row waits a whole 1M-token window before it can be re-drawn again).
set -uo pipefail
t0=$(date +%s)
source docs/results/2026-12-05/common.sh
echo "setup $(( $(date +%s) - t0 )) s"; nvidia-smi --query-gpu=name --format=csv,noheader
tests=(tests/kernels/test_fast_launch.py tests/kernels/training/test_train.py tests/kernels/test_reinit.py)
timeout 150 python3 -m pytest -q -p no:cacheprovider "${tests[@]}" > $OUT/gpu_tests.txt 2>&1
echo "gpu tests rc $? t $(( $(date +%s) - t0 )) s"; grep -E "passed|failed|^FAILED|^E " $OUT/gpu_tests.txt | head -12
[ "${SPLIT:-1}" = 0 ] || timeout 80 python3 docs/results/2026-12-05-f/host_split2.py $OUT/host_split2.json > $OUT/host_split2.txt 2>&1; echo "host split rc $?"
python3 -c "import json; r=json.load(open('$OUT/host_split2.json')); print({k: v for k, v in r.items() if not k.endswith('_ops')})" 2>&1 | head -20
echo "t $(( $(date +%s) - t0 )) s"
left=$(( ${TOTAL:-530} - ($(date +%s) - t0) ))
timeout -k 15 $left python3 scripts/race.py --out /tmp/r1.5b --settle 50 --repeats 2 -- experiment=paper_1.5b $RACE_16K train.steps=100 > $OUT/race_1.5b.txt 2>&1
rc=$?; echo "race 1.5b rc $rc t $(( $(date +%s) - t0 )) s"
[ $rc -eq 0 ] || python3 scripts/race.py --out /tmp/r1.5b --settle 50 --repeats 2 --no-run >> $OUT/race_1.5b.txt 2>&1
tail -14 $OUT/race_1.5b.txt
tar -czf $OUT/race_1.5b.tgz --exclude=checkpoints -C /tmp r1.5b 2>/dev/null
echo "total $(( $(date +%s) - t0 )) s"
