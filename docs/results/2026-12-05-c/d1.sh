#!/usr/bin/env bash
# Session 2026-12-05 (c), call 1: the fused decode FFN at 64 / 32 / 16 units per program per layer (bench_ffn,
# 8 layers in one CUDA graph, outputs checked) and in the 1.5b decode step (decode_tiles.py); the re-init
# kernel's tests on the GPU and its cost against PyTorch's (reinit_cost.py); launch_probe (host us a launch);
# the decode attention kernel against SDPA per layer (attention_decode.py) and in the decode step.
# `d1.sh short` (a smaller device budget): the decode checks alone, four variants of the decode step;
# `d1.sh tests` (a few minutes): the new kernels' GPU tests, the attention microbenchmark, the re-init's cost.
set -uo pipefail
short=${1:-}
t0=$(date +%s)
source docs/results/2026-12-05/common.sh
echo "setup $(( $(date +%s) - t0 )) s"
[ "$short" = tests ] || timeout 90 python3 scripts/bench_ffn.py --tokens 1 2 --d-ff 5632 --fused-tiles 16 32 --rep 50 \
  --out $OUT/bench_ffn_tiles.json > $OUT/bench_ffn_tiles.txt 2>&1; echo "bench_ffn rc $?"
grep -E "^ *tokens|fused|d16" $OUT/bench_ffn_tiles.txt | cut -c1-220
echo "t $(( $(date +%s) - t0 )) s"
timeout 45 python3 docs/results/2026-12-05-c/attention_decode.py $OUT/attention_decode.json > $OUT/attention_decode.txt 2>&1
echo "attention rc $?"; tail -4 $OUT/attention_decode.txt
timeout 70 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_reinit.py tests/kernels/inference/test_inference.py tests/kernels/inference/test_decode_attention.py -k "reinit or noise or dead_row or fused_with_fewer or decode_attention or splits" > $OUT/reinit_tests.txt 2>&1; echo "reinit tests rc $?"; tail -2 $OUT/reinit_tests.txt
if [ "$short" != short ]; then
  timeout 45 python3 docs/results/2026-12-05-c/reinit_cost.py > $OUT/reinit_cost.txt 2>&1; echo "reinit cost rc $?"; tail -6 $OUT/reinit_cost.txt
fi
if [ "$short" = tests ]; then echo "total $(( $(date +%s) - t0 )) s"; exit 0; fi
if [ -z "$short" ]; then
  timeout 30 python3 docs/results/2026-12-05-b/launch_probe.py $OUT/launch_probe.json > $OUT/launch_probe.txt 2>&1
  echo "launch probe rc $?"; tail -12 $OUT/launch_probe.txt
  variants=() limit=250
else
  variants=(--variants dense:64:sdpa twell:64:sdpa twell:32:sdpa twell:32:flash_decode) limit=180
fi
echo "t $(( $(date +%s) - t0 )) s"
timeout $limit python3 docs/results/2026-12-05-c/decode_tiles.py $OUT/decode_tiles.json "${variants[@]}" > $OUT/decode_tiles.txt 2>&1
echo "decode_tiles rc $?"; grep -E "batch|Error|error" $OUT/decode_tiles.txt | tail -8
echo "total $(( $(date +%s) - t0 )) s"
