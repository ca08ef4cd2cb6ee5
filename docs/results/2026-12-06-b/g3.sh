#!/usr/bin/env bash
# Session (b) of 2026-12-06, call 3 (~6.5 min, the budget's end): the graphs' GPU tests after the pool fix
# (a released memory pool was captured into again: an allocator assert in call 2), then the 1.5b race,
# the sparse twin without the per-layer graphs (default) against the dense twin and the sparse twin with
# them on (train.twell_graphs=true, opt-in).
set -uo pipefail
t0=$(date +%s)
source docs/results/2026-12-05/common.sh
echo "setup $(( $(date +%s) - t0 )) s"; nvidia-smi --query-gpu=name --format=csv,noheader
timeout 75 python3 -m pytest -q -p no:cacheprovider tests/kernels/training/test_train_graph.py > $OUT/gpu_tests.txt 2>&1
echo "gpu tests rc $? t $(( $(date +%s) - t0 )) s"; grep -E "passed|failed|^FAILED|^E " $OUT/gpu_tests.txt | head -16
left=$(( ${TOTAL:-370} - ($(date +%s) - t0) ))
timeout -k 10 $left python3 scripts/race.py --out /tmp/r1.5b --settle 50 \
  --variant op_graphs "train.twell_graphs=true" -- experiment=paper_1.5b $RACE_16K train.steps=100 > $OUT/race_1.5b.txt 2>&1
rc=$?; echo "race 1.5b rc $rc t $(( $(date +%s) - t0 )) s"
[ $rc -eq 0 ] || python3 scripts/race.py --out /tmp/r1.5b --settle 50 --variant op_graphs "train.twell_graphs=true" --no-run >> $OUT/race_1.5b.txt 2>&1
tail -7 $OUT/race_1.5b.txt
python3 - <<'PY'
import glob, json
for f in sorted(glob.glob("/tmp/r1.5b/*/metrics.jsonl")):
    for line in open(f):
        r = json.loads(line)
        if "tokens_per_s" in r and r["step"] % 20 == 0:
            print(f.split("/")[-2], r["step"], round(r["tokens_per_s"]), {k[12:]: v for k, v in r.items() if k.startswith("twell_graph_")})
PY
grep -h "failed (" /tmp/r1.5b/*.log | sort | uniq -c | head -3 | cut -c1-300
tar -czf $OUT/race_1.5b.tgz --exclude=checkpoints -C /tmp r1.5b 2>/dev/null
echo "total $(( $(date +%s) - t0 )) s"
