# Next call (not run: no machine could be started after call 1): FSDP2 against plain with TwELL at lr 1e-12
# (bench_fsdp's default since 2169073: call 1's TwELL runs left the calibrated activity, 29 -> 2,300 units a
# token in 24 steps), logging every 2 steps; fsdp is train.fsdp_reshard_after_forward=auto, which keeps every
# block gathered on one rank since 19aff83 (call 1's auto gathered every block but the last again for its
# backward: the fsdp_reshard variant); then 0.5b
source docs/results/2026-12-07-d/head.sh
A="--steps 24 --settle 8 -- logging.log_interval=2"
bench fsdp_1.5b_dense 200 scripts/bench_fsdp.py --out $OUT/fsdp_1.5b_dense --model 1.5b --ffn dense --variants plain fsdp fsdp_reshard $A
bench fsdp_1.5b_twell 170 scripts/bench_fsdp.py --out $OUT/fsdp_1.5b_twell --model 1.5b --ffn twell $A
bench fsdp_0.5b 160 scripts/bench_fsdp.py --out $OUT/fsdp_0.5b --model 0.5b --ffn dense twell $A
(cd $OUT && tar czf runs.tgz --exclude='launches*' fsdp_* && rm -rf fsdp_*/)
