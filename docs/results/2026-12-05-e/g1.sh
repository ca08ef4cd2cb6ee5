#!/usr/bin/env bash
# Session (e), call 1 (~3 min on one H200): the host cost of one launch (Triton's paths against the compiled
# kernel's own launcher, small aten ops) and the TwELL op's host time split by function, with the GPU kept
# busy so that only the host's issue time is timed (issue 31).
set -uo pipefail
t0=$(date +%s)
source docs/results/2026-12-05/common.sh
echo "setup $(( $(date +%s) - t0 )) s"
timeout 60 python3 docs/results/2026-12-05-b/launch_probe.py $OUT/launch_probe.json > $OUT/launch_probe.txt 2>&1; echo "launch probe rc $?"; tail -14 $OUT/launch_probe.txt
echo "t $(( $(date +%s) - t0 )) s"
timeout 300 python3 docs/results/2026-12-05-e/host_split.py $OUT/host_split.json > $OUT/host_split.txt 2>&1; echo "host split rc $?"; tail -60 $OUT/host_split.txt
echo "total $(( $(date +%s) - t0 )) s"
