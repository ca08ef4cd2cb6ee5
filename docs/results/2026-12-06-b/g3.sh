#!/usr/bin/env bash
# Session (b) of 2026-12-06, call 3 (not run: no device time left; ~6.5 min): the graphs' GPU tests after
# the pool fix (call 2: a released memory pool captured into again, an allocator assert), then the 1.5b
# race: dense twin, sparse twin (graphs off, the default) and the sparse twin with them on.
set -uo pipefail
t0=$(date +%s)
source docs/results/2026-12-05/common.sh
source docs/results/2026-12-06-b/race_ab.sh
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 75 python3 -m pytest -q -p no:cacheprovider tests/kernels/training/test_train_graph.py > $OUT/gpu_tests.txt 2>&1
echo "gpu tests rc $? t $(( $(date +%s) - t0 )) s"; grep -E "passed|failed|^FAILED|^E " $OUT/gpu_tests.txt | head -16
race_ab 1.5b $(( ${TOTAL:-370} - ($(date +%s) - t0) ))
echo "total $(( $(date +%s) - t0 )) s"
