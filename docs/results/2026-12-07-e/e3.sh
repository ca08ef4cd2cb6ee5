# Next call (not run: no device time was left): does the TwELL op's per-layer entry-count sync (sizes
# "estimate") make FSDP2's per-block host work GPU idle time? The 0.5b and 1.5b TwELL pairs with every layer
# sized without a sync (train.twell_sizes=deferred), against call 1's and call 2's estimate pairs; the
# profile gives the forward's idle time. Since this session data=local sets data.prefetch=4 (calls 0-2 ran at 0:
# 55-75 ms of each 0.5b step waited for tokenization on the training thread), so rerun the estimate pairs too.
source docs/results/2026-12-07-d/head.sh
P="logging.log_interval=2 logging.profile_at=8 logging.profile_steps=2"
bench fsdp_0.5b 150 scripts/bench_fsdp.py --out $OUT/fsdp_0.5b --model 0.5b --ffn twell --steps 12 --settle 4 -- $P
bench fsdp_0.5b_deferred 150 scripts/bench_fsdp.py --out $OUT/fsdp_0.5b_deferred --model 0.5b --ffn twell --steps 12 --settle 4 -- $P train.twell_sizes=deferred
bench fsdp_1.5b_deferred 200 scripts/bench_fsdp.py --out $OUT/fsdp_1.5b_deferred --model 1.5b --ffn twell --steps 12 --settle 4 -- $P train.twell_sizes=deferred
(cd $OUT && tar czf runs.tgz --exclude='launches*' --exclude='*.trace.json' fsdp_* && rm -rf fsdp_*/)
