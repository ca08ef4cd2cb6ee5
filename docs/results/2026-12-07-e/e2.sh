# Call 2 of session (e), on the machine call 1 left warm: the 0.5b TwELL pair and the 0.5b memory rows with
# activation checkpointing (compiled)
source docs/results/2026-12-07-d/head.sh
bench fsdp_0.5b_twell 150 scripts/bench_fsdp.py --out $OUT/fsdp_0.5b_twell --model 0.5b --ffn twell --steps 12 --settle 4 -- logging.log_interval=2
bench memory 110 scripts/bench_memory.py --out $OUT/memory --models 0.5b --compile --checkpointing on
(cd $OUT && tar czf runs.tgz --exclude='launches*' fsdp_* memory && rm -rf fsdp_*/ memory/)
