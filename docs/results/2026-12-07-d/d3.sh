# Next call after d2.sh (not run): the memory planner against compiled runs, checkpointing on and off, dense
# and TwELL (calibrated), 0.5b then 1.5b: the rows issue 33 asks for that no GPU run has measured yet
source docs/results/2026-12-07-d/head.sh
bench memory 540 scripts/bench_memory.py --out $OUT/memory --models 0.5b 1.5b --compile
(cd $OUT && tar czf memory.tgz --exclude='launches*' memory && rm -rf memory)
