#!/usr/bin/env bash
# Session 2026-12-05 (c), decode call (issue 34): the fused decode FFN at 64 / 32 / 16 units per program, per
# layer (bench_ffn, 8 layers in one CUDA graph, every output checked) and in the 1.5b decode step
# (decode_tiles.py: calibrated model, compiled blocks, CUDA graphs), then launch_probe (issue 31).
set -uo pipefail
t0=$(date +%s)
source docs/results/2026-12-05/common.sh
echo "setup $(( $(date +%s) - t0 )) s"
timeout 150 python3 scripts/bench_ffn.py --tokens 1 2 4 --d-ff 5632 8192 --fused-tiles 16 32 --rep 50 \
  --out $OUT/bench_ffn_tiles.json > $OUT/bench_ffn_tiles.txt 2>&1; echo "bench_ffn rc $?"
grep -E "^ *tokens|fused|d-fused| d16 " $OUT/bench_ffn_tiles.txt | cut -c1-200
echo "t $(( $(date +%s) - t0 )) s"
timeout 240 python3 docs/results/2026-12-05-c/decode_tiles.py $OUT/decode_tiles.json > $OUT/decode_tiles.txt 2>&1
echo "decode_tiles rc $?"; grep -E "batch|Error|error" $OUT/decode_tiles.txt | tail -12
echo "t $(( $(date +%s) - t0 )) s"
timeout 40 python3 docs/results/2026-12-05-b/launch_probe.py $OUT/launch_probe.json > $OUT/launch_probe.txt 2>&1
echo "launch probe rc $?"; tail -14 $OUT/launch_probe.txt
echo "total $(( $(date +%s) - t0 )) s"
timeout 60 python3 docs/results/2026-12-05-c/reinit_cost.py > $OUT/reinit_cost.txt 2>&1; echo "reinit cost rc $?"; tail -5 $OUT/reinit_cost.txt
echo "total $(( $(date +%s) - t0 )) s"
