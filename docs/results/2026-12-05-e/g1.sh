#!/usr/bin/env bash
# Session (e), call 1 (~5 min on one H200): GPU tests of the kept-kernel launches (kernels/_launch.py) and
# of the training op, then the host cost of a launch and of the TwELL op and a 4-layer 1.5b-wide model,
# with the GPU kept busy so that only the host's issue time is timed, Triton's front end against fast()
# (issue 31).
set -uo pipefail
t0=$(date +%s)
source docs/results/2026-12-05/common.sh
echo "setup $(( $(date +%s) - t0 )) s"
timeout 200 python3 -m pytest -x -q -p no:cacheprovider tests/kernels/test_fast_launch.py tests/kernels/training/test_train.py \
  tests/kernels/test_reinit.py > $OUT/gpu_tests.txt 2>&1; echo "gpu tests rc $?"; tail -4 $OUT/gpu_tests.txt
echo "t $(( $(date +%s) - t0 )) s"
timeout 300 python3 docs/results/2026-12-05-e/host_split.py $OUT/host_split.json > $OUT/host_split.txt 2>&1; echo "host split rc $?"; tail -80 $OUT/host_split.txt
echo "total $(( $(date +%s) - t0 )) s"
