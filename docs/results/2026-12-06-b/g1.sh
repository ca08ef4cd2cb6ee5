#!/usr/bin/env bash
# Session (b) of 2026-12-06, call 1 (at most ~9.3 min: every step has a time limit). The per-layer CUDA
# graphs of the TwELL forward (kernels/training/train_graph.py): their GPU tests and the op's tests on
# this tree; bench_train at 16,384 tokens with the graphs on and off (eager, compiled, one whole-step CUDA
# graph, each row's host issue time: issue 31); then the 0.5b race with a third run, the sparse twin with
# the graphs off (train.twell_graphs=false), for a same-node A/B (issue 30).
set -uo pipefail
t0=$(date +%s)
source docs/results/2026-12-05/common.sh
echo "setup $(( $(date +%s) - t0 )) s"; nvidia-smi --query-gpu=name --format=csv,noheader
tests=(tests/kernels/training/test_train_graph.py tests/kernels/training/test_train.py)
timeout 200 python3 -m pytest -q -p no:cacheprovider -x "${tests[@]}" > $OUT/gpu_tests.txt 2>&1
echo "gpu tests rc $? t $(( $(date +%s) - t0 )) s"; grep -E "passed|failed|^FAILED|^E " $OUT/gpu_tests.txt | head -20
timeout 170 python3 scripts/bench_train.py --tokens 16384 --d-ff 5632 --hot-units 1024 --variants fused3 \
  --op-graphs on off --twell-compile --cuda-graph --out $OUT/bench_train.json > $OUT/bench_train.txt 2>&1
echo "bench_train rc $? t $(( $(date +%s) - t0 )) s"; tail -22 $OUT/bench_train.txt | cut -c1-230
left=$(( ${TOTAL:-545} - ($(date +%s) - t0) ))
timeout -k 15 $left python3 scripts/race.py --out /tmp/r0.5b --settle 50 \
  --variant no_op_graphs "train.twell_graphs=false" -- experiment=paper_0.5b $RACE_16K train.steps=100 > $OUT/race_0.5b.txt 2>&1
rc=$?; echo "race 0.5b rc $rc t $(( $(date +%s) - t0 )) s"
[ $rc -eq 0 ] || python3 scripts/race.py --out /tmp/r0.5b --settle 50 --variant no_op_graphs "train.twell_graphs=false" --no-run >> $OUT/race_0.5b.txt 2>&1
tail -14 $OUT/race_0.5b.txt
grep -rh --include=*.jsonl twell_graph /tmp/r0.5b 2>/dev/null | tail -2 | cut -c1-400
tar -czf $OUT/race_0.5b.tgz --exclude=checkpoints -C /tmp r0.5b 2>/dev/null
echo "total $(( $(date +%s) - t0 )) s"
