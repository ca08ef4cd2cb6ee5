# Call 1: the TwELL op's sizes "late" (the forward never waits for its entry count; the backward checks it)
# against estimate (one host sync a layer) and deferred: the op at 16k tokens (correctness against fp32
# and host/GPU time per fwd+bwd), then the 0.5b FSDP2-vs-plain pairs (issue 33), estimate and late.
source docs/results/2026-12-07-d/head.sh
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/kernels/training/test_train.py -k "late or opcheck" > $OUT/gpu_tests.txt 2>&1
printf 'gpu tests rc %s t %s s\n' "$?" "$(( $(date +%s) - t0 ))"; tail -3 $OUT/gpu_tests.txt
bench op_sizes 170 scripts/bench_train.py --quick --no-compile --sizes estimate late deferred --variants fused3 --hot-units 1024 --out $OUT/bench_train.json
P="logging.log_interval=2 logging.profile_at=8 logging.profile_steps=2"
bench fsdp_0.5b_estimate 150 scripts/bench_fsdp.py --out $OUT/fsdp_0.5b_estimate --model 0.5b --ffn twell --steps 12 --settle 4 -- $P
bench fsdp_0.5b_late 150 scripts/bench_fsdp.py --out $OUT/fsdp_0.5b_late --model 0.5b --ffn twell --steps 12 --settle 4 -- $P train.twell_sizes=late
(cd $OUT && tar czf runs.tgz --exclude='launches*' --exclude='*.trace.json' fsdp_* && rm -rf fsdp_*/)
