# Call 1 (session 2026-12-08): the TwELL op's sizes "late" sized by a high-water mark (a late miss walks the
# rows past the slots in h and rebuilds the entries in the backward; session (f)'s 1/8 margin missed in
# ~2 of 16 calls a step at 0.5b, and each missed row kernel took ~6 ms). GPU tests of the late sizes and
# the row kernel; the 0.5b TwELL plain-vs-FSDP2 pairs, estimate and late; then, while the call's time
# allows, the 1.5b plain runs, late and estimate; all on the same machine.
source docs/results/2026-12-07-d/head.sh
timeout 40 python3 -m pytest -q -p no:cacheprovider tests/kernels/training/test_rowfwd.py > $OUT/gpu_tests.txt 2>&1
timeout 50 python3 -m pytest -q -p no:cacheprovider tests/kernels/training/test_train.py -k "late_sizes_never_wait or late_backward" >> $OUT/gpu_tests.txt 2>&1
printf 'gpu tests rc %s t %s s\n' "$?" "$(( $(date +%s) - t0 ))"; grep -E "passed|failed|error" $OUT/gpu_tests.txt
P="logging.log_interval=2 logging.profile_at=8 logging.profile_steps=2"
bench fsdp_0.5b_estimate 140 scripts/bench_fsdp.py --out $OUT/fsdp_0.5b_estimate --model 0.5b --ffn twell --steps 14 --settle 4 -- $P
bench fsdp_0.5b_late 140 scripts/bench_fsdp.py --out $OUT/fsdp_0.5b_late --model 0.5b --ffn twell --steps 14 --settle 4 -- $P train.twell_sizes=late
for s in late estimate; do
  left=$(( ${END:-560} - ($(date +%s) - t0) )); [ $left -gt 100 ] || { echo "1.5b $s skipped: $left s left"; continue; }
  bench fsdp_1.5b_$s $left scripts/bench_fsdp.py --out $OUT/fsdp_1.5b_$s --model 1.5b --ffn twell --variants plain --steps 12 --settle 4 -- $P train.twell_sizes=$s
done
for d in $OUT/fsdp_*/twell_*/; do printf '%s ' "$d"; grep -o "\"twell_misses_[a-z]*\": [0-9]*" $d/metrics.jsonl | tail -2 | tr '\n' ' '; echo; done
(cd $OUT && tar czf runs.tgz --exclude='launches*' --exclude='*.trace.json' fsdp_* && rm -rf fsdp_*/)
