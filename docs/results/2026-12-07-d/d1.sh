# Call 1: FSDP2 at world size 1 against plain training, 1.5b, dense and TwELL (calibrated start), compiled
source docs/results/2026-12-07-d/head.sh
bench fsdp_1.5b 540 scripts/bench_fsdp.py --out $OUT/fsdp_1.5b --model 1.5b --ffn dense twell --steps 24 --settle 9 -- optim.warmup_steps=1000
