#!/usr/bin/env bash
# Session (e), call 3 (~5 min): GPU tests of kernels/_launch.py and the training op (streams now "auto":
# one stream outside CUDA graph captures), then host_split.py: the host path before this session (Triton's
# front end, a side stream) against after it (kept compiled kernels, one stream), for one launch, the op
# and a 4-layer 1.5b-wide compiled model, with the GPU kept busy (issue 31).
set -uo pipefail
t0=$(date +%s)
source docs/results/2026-12-05/common.sh
echo "setup $(( $(date +%s) - t0 )) s"
timeout 170 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_fast_launch.py tests/kernels/training/test_train.py \
  tests/kernels/test_reinit.py > $OUT/gpu_tests.txt 2>&1; echo "gpu tests rc $?"; grep -E "passed|failed|^FAILED|^E " $OUT/gpu_tests.txt | head -12
echo "t $(( $(date +%s) - t0 )) s"
timeout 250 python3 docs/results/2026-12-05-e/host_split.py $OUT/host_split.json > $OUT/host_split.txt 2>&1; echo "host split rc $?"; tail -70 $OUT/host_split.txt
echo "total $(( $(date +%s) - t0 )) s"
