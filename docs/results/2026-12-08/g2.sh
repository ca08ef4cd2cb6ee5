# The smaller call when little device time is left (g1.sh's first half): the row kernel's GPU tests, the
# 0.5b TwELL pair with sizes late (plain and FSDP2), then the 0.5b plain run with sizes estimate, the
# baseline on the same machine; each run only while the call's time (END s) allows.
source docs/results/2026-12-07-d/head.sh
timeout 30 python3 -m pytest -q -p no:cacheprovider tests/kernels/training/test_rowfwd.py > $OUT/gpu_tests.txt 2>&1
printf 'gpu tests rc %s t %s s\n' "$?" "$(( $(date +%s) - t0 ))"; grep -E "passed|failed|error" $OUT/gpu_tests.txt
P="logging.log_interval=2 logging.profile_at=8 logging.profile_steps=2"
run() {
  local left=$(( ${END:-560} - ($(date +%s) - t0) )); [ $left -gt 60 ] || { echo "$1 skipped: $left s left"; return; }
  bench "$1" $left scripts/bench_fsdp.py --out $OUT/$1 --model 0.5b --ffn twell --steps 14 --settle 4 "${@:2}"
}
run fsdp_0.5b_late -- $P train.twell_sizes=late
run fsdp_0.5b_estimate --variants plain -- $P
for d in $OUT/fsdp_*/twell_*/; do printf '%s ' "$d"; grep -o "\"twell_misses_[a-z]*\": [0-9]*" $d/metrics.jsonl | tail -2 | tr '\n' ' '; echo; done
(cd $OUT && tar czf runs.tgz --exclude='launches*' --exclude='*.trace.json' fsdp_* && rm -rf fsdp_*/)
