#!/usr/bin/env bash
# GPU call 2: the user-launched paper recipe (defaults: ffn auto, compile auto, AC auto) vs its dense twin,
# real trainer, offline sample data, 16k-token steps; L1 1e-3 so the layers go sparse inside the run.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit
mkdir -p /tmp/twell_ns/twell; for p in kernels model data training eval; do ln -sfn $PWD/$p /tmp/twell_ns/twell/$p; done
export PYTHONPATH=/tmp/twell_ns:$PYTHONPATH PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false
export TRITON_CACHE_DIR=/tmp/triton_cache
python3 scripts/prepare_offline_data.py > $OUT/prep.txt 2>&1 || { tail $OUT/prep.txt; exit 1; }
common="experiment=paper_0.5b data=local train.global_batch_tokens=16384 train.micro_batch=8 train.seq_len=2048 sparsity.l1_coef=1e-3 logging.log_interval=10 logging.console=true eval.interval=0 checkpoint.interval=0 optim.warmup_steps=20"
STEPS=${STEPS:-160}
timeout 260 python3 train.py $common run_name=sparse run_dir=/tmp/runs/sparse train.steps=$STEPS 2>&1 | tee $OUT/sparse.txt | grep -vE "^\s*$" | tail -30
timeout 200 python3 train.py $common run_name=dense run_dir=/tmp/runs/dense train.steps=$STEPS model.ffn_impl=dense 2>&1 | tee $OUT/dense.txt | grep -vE "^\s*$" | tail -22
cp /tmp/runs/sparse/metrics.jsonl $OUT/sparse_metrics.jsonl 2>/dev/null; cp /tmp/runs/dense/metrics.jsonl $OUT/dense_metrics.jsonl 2>/dev/null
ls /tmp/runs/sparse
