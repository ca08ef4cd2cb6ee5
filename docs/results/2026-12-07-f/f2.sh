# Call 2: the 1.5b FSDP2-vs-plain TwELL pairs (issue 33), sizes estimate and late, with the data groups'
# read-ahead (data.prefetch=4) on both sides.
source docs/results/2026-12-07-d/head.sh
P="logging.log_interval=2 logging.profile_at=8 logging.profile_steps=2"
bench fsdp_1.5b_late 230 scripts/bench_fsdp.py --out $OUT/fsdp_1.5b_late --model 1.5b --ffn twell --steps 12 --settle 4 -- $P train.twell_sizes=late
bench fsdp_1.5b_estimate 230 scripts/bench_fsdp.py --out $OUT/fsdp_1.5b_estimate --model 1.5b --ffn twell --steps 12 --settle 4 -- $P
(cd $OUT && tar czf runs.tgz --exclude='launches*' --exclude='*.trace.json' fsdp_* && rm -rf fsdp_*/)
