#!/usr/bin/env bash
# Session (b) of 2026-12-06, call 2 (at most ~9.3 min). The forward AND backward graphs per layer: the
# GPU tests of train_graph.py and the op; bench_train at 16,384 tokens (graphs on / off, eager, compiled,
# one whole-step graph) and at 65,536 (graphs on; issue 31's 3x row); the 0.5b race with the graphs-off
# sparse twin as a third run (issue 30).
set -uo pipefail
t0=$(date +%s)
source docs/results/2026-12-05/common.sh
echo "setup $(( $(date +%s) - t0 )) s"; nvidia-smi --query-gpu=name --format=csv,noheader
tests=(tests/kernels/training/test_train_graph.py tests/kernels/training/test_train.py)
timeout 190 python3 -m pytest -q -p no:cacheprovider "${tests[@]}" > $OUT/gpu_tests.txt 2>&1
echo "gpu tests rc $? t $(( $(date +%s) - t0 )) s"; grep -E "passed|failed|^FAILED|^E " $OUT/gpu_tests.txt | head -24
timeout 130 python3 scripts/bench_train.py --tokens 16384 --d-ff 5632 --hot-units 1024 --variants fused3 \
  --op-graphs on off --twell-compile --cuda-graph --out $OUT/bench_train_16k.json > $OUT/bench_train_16k.txt 2>&1
echo "bench_train 16k rc $? t $(( $(date +%s) - t0 )) s"; grep -A30 "^all shapes" $OUT/bench_train_16k.txt | cut -c1-200; grep "replayed" $OUT/bench_train_16k.txt
timeout 90 python3 scripts/bench_train.py --tokens 65536 --d-ff 5632 --hot-units 1024 --variants fused3 \
  --no-compile --cuda-graph --out $OUT/bench_train_64k.json > $OUT/bench_train_64k.txt 2>&1
echo "bench_train 64k rc $? t $(( $(date +%s) - t0 )) s"; grep -A16 "^all shapes" $OUT/bench_train_64k.txt | cut -c1-200; grep "replayed" $OUT/bench_train_64k.txt
left=$(( ${TOTAL:-548} - ($(date +%s) - t0) ))
timeout -k 15 $left python3 scripts/race.py --out /tmp/r0.5b --settle 50 \
  --variant no_op_graphs "train.twell_graphs=false" -- experiment=paper_0.5b $RACE_16K train.steps=100 > $OUT/race_0.5b.txt 2>&1
rc=$?; echo "race 0.5b rc $rc t $(( $(date +%s) - t0 )) s"
[ $rc -eq 0 ] || python3 scripts/race.py --out /tmp/r0.5b --settle 50 --variant no_op_graphs "train.twell_graphs=false" --no-run >> $OUT/race_0.5b.txt 2>&1
tail -8 $OUT/race_0.5b.txt
python3 - <<'PY'
import glob, json
for f in sorted(glob.glob("/tmp/r0.5b/*/metrics.jsonl")):
    for line in open(f):
        r = json.loads(line)
        if "tokens_per_s" in r and r["step"] % 20 == 0:
            print(f.split("/")[-2], r["step"], round(r["tokens_per_s"]), {k[12:]: v for k, v in r.items() if k.startswith("twell_graph_")})
PY
tar -czf $OUT/race_0.5b.tgz --exclude=checkpoints -C /tmp r0.5b 2>/dev/null
echo "total $(( $(date +%s) - t0 )) s"
