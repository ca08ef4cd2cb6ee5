#!/usr/bin/env bash
# Session 2026-12-05, call 3: where a 1.5b step's time goes in the real trainer (logging.profile_at, dense
# twin and sparse once switched), time to first token with each row compiled afresh (34), and compiled
# 1.5b TwELL with checkpointing off / on (selective): peak vs plan, step time (31/33).
set -uo pipefail
t0=$(date +%s)
source .gpu/common.sh
echo "setup $(( $(date +%s) - t0 )) s"
timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/inference/test_inference.py -k fused > $OUT/fused_tests.txt 2>&1; echo "fused gpu tests rc $?"; tail -2 $OUT/fused_tests.txt
echo "t $(( $(date +%s) - t0 )) s"
TRITON_PRINT_AUTOTUNING=1 timeout 150 python3 scripts/bench_generate.py --models 1.5b --batch 1 8 --new-tokens 64 --repeats 2 --profile $OUT/genprof --out $OUT/gen > $OUT/gen.txt 2>&1; echo "gen rc $?"; tail -6 $OUT/gen.txt; grep -A3 "_fused_decode_kernel" $OUT/gen.txt | grep "best config" | head -3
echo "t $(( $(date +%s) - t0 )) s"
common="experiment=paper_1.5b data=local train.global_batch_tokens=16384 train.micro_batch=8 train.seq_len=2048 sparsity.l1_coef=1e-3 logging.log_interval=10 eval.interval=0 checkpoint.interval=0 checkpoint.save_final=false optim.warmup_steps=20"
timeout 140 python3 train.py $common run_dir=/tmp/p15s run_name=p15s train.steps=74 logging.profile_at=70 > $OUT/prof_sparse_log.txt 2>&1; echo "sparse rc $?"
grep -A12 "profile of steps" $OUT/prof_sparse_log.txt; grep -E "^step (60|70)/" $OUT/prof_sparse_log.txt | cut -c1-250
echo "t $(( $(date +%s) - t0 )) s"
timeout 110 python3 train.py $common run_dir=/tmp/p15d run_name=p15d model.ffn_impl=dense train.steps=34 logging.profile_at=30 > $OUT/prof_dense_log.txt 2>&1; echo "dense rc $?"
grep -A12 "profile of steps" $OUT/prof_dense_log.txt; grep -E "^step 30/" $OUT/prof_dense_log.txt | cut -c1-250
echo "t $(( $(date +%s) - t0 )) s"
mkdir -p $OUT/prof; for r in p15s p15d; do cp /tmp/$r/profile/*.txt $OUT/prof/${r}_summary.txt 2>/dev/null; gzip -c /tmp/$r/profile/*.trace.json > $OUT/prof/${r}_trace.json.gz 2>/dev/null; cp /tmp/$r/metrics.jsonl $OUT/prof/${r}_metrics.jsonl; done
rem=$(( 470 - ($(date +%s) - t0) )); echo "left for bench_memory: $rem s"
if [ $rem -gt 120 ]; then
timeout $rem python3 scripts/bench_memory.py --out /tmp/bmc --models 1.5b --ffn twell --steps 6 -- train.compile=true > $OUT/bmc.txt 2>&1; echo "bench_memory compiled rc $?"; tail -8 $OUT/bmc.txt
tar -czf $OUT/bmc.tgz -C /tmp bmc 2>/dev/null
fi
echo "total $(( $(date +%s) - t0 )) s"
