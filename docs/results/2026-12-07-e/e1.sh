# Call 1 of session (e). (1) Why TwELL under FSDP2 on one rank ran ~9% behind plain at 1.5b in call 0
# (d2.sh, H100: plain ~49.6k, fsdp ~45.1k tokens/s over steps 10-24) where dense ran 2.7% behind: the 1.5b
# pair again, FSDP2 now keeping its blocks gathered between micro-batches, with a profile of steps 9-10
# (GPU busy / idle per trainer phase). (2) The memory planner's compiled rows with activation checkpointing,
# which no GPU run has measured.
source docs/results/2026-12-07-d/head.sh
P="logging.log_interval=2 logging.profile_at=8 logging.profile_steps=2"
bench fsdp_1.5b_twell 200 scripts/bench_fsdp.py --out $OUT/fsdp_1.5b_twell --model 1.5b --ffn twell --steps 12 --settle 4 -- $P
bench memory 150 scripts/bench_memory.py --out $OUT/memory --models 1.5b --compile --checkpointing on
(cd $OUT && tar czf runs.tgz --exclude='launches*' --exclude='*.trace.json' fsdp_* memory && rm -rf fsdp_*/ memory/)
