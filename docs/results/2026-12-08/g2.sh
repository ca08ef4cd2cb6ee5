# Call 2 (session 2026-12-08): the 1.5b TwELL pairs: late (plain and FSDP2) and estimate (plain), same machine.
source docs/results/2026-12-07-d/head.sh
P="logging.log_interval=2 logging.profile_at=8 logging.profile_steps=2"
bench fsdp_1.5b_late 240 scripts/bench_fsdp.py --out $OUT/fsdp_1.5b_late --model 1.5b --ffn twell --steps 14 --settle 4 -- $P train.twell_sizes=late
bench fsdp_1.5b_estimate 130 scripts/bench_fsdp.py --out $OUT/fsdp_1.5b_estimate --model 1.5b --ffn twell --variants plain --steps 14 --settle 4 -- $P
for d in $OUT/fsdp_*/twell_*/; do printf '%s ' "$d"; grep -o "\"twell_misses_[a-z]*\": [0-9]*" $d/metrics.jsonl | tail -2 | tr '\n' ' '; echo; done
(cd $OUT && tar czf runs.tgz --exclude='launches*' --exclude='*.trace.json' fsdp_* && rm -rf fsdp_*/)
