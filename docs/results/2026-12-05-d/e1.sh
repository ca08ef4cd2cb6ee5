#!/usr/bin/env bash
# Session 2026-12-05 (d), one call for everything most needed if only one machine comes (~520 s): the GPU tests
# of session (c)'s kernels (re-init, decode attention, fused tiles), the 1.5b decode step at batch 1 with SDPA
# against the Triton decode attention and 64 / 32 units per fused-FFN program (decode_tiles.py), then the 1.5b
# race on this commit (issue 30's README row).
set -uo pipefail
t0=$(date +%s)
source docs/results/2026-12-05/common.sh
echo "setup $(( $(date +%s) - t0 )) s"
timeout 80 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_reinit.py tests/kernels/inference/test_inference.py \
  tests/kernels/inference/test_decode_attention.py -k "reinit or noise or dead_row or fused_with_fewer or decode_attention or splits" \
  > $OUT/gpu_tests.txt 2>&1; echo "gpu tests rc $?"; tail -2 $OUT/gpu_tests.txt
echo "t $(( $(date +%s) - t0 )) s"
timeout 170 python3 docs/results/2026-12-05-c/decode_tiles.py $OUT/decode_tiles.json \
  --variants dense:64:sdpa twell:64:sdpa twell:64:flash_decode twell:32:flash_decode > $OUT/decode_tiles.txt 2>&1
echo "decode_tiles rc $?"; grep -E "batch|Error|error" $OUT/decode_tiles.txt | tail -6
echo "t $(( $(date +%s) - t0 )) s"
common="experiment=paper_1.5b $RACE_16K"
left=$(( 575 - ($(date +%s) - t0) ))
timeout $left python3 scripts/race.py --out /tmp/race15 --settle 50 -- $common train.steps=100 > $OUT/race15.txt 2>&1
echo "race rc $? (limit $left s)"; tail -9 $OUT/race15.txt
tar -czf $OUT/race15.tgz -C /tmp race15 2>/dev/null
echo "total $(( $(date +%s) - t0 )) s"
