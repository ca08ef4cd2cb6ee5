#!/usr/bin/env bash
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit
mkdir -p /tmp/twell_ns/twell; for p in kernels model data training eval; do ln -sfn $PWD/$p /tmp/twell_ns/twell/$p; done
export PYTHONPATH=/tmp/twell_ns:$PYTHONPATH PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false
python3 scripts/prepare_offline_data.py > $OUT/prep.txt 2>&1 || { tail $OUT/prep.txt; exit 1; }
timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/training/test_fast_path.py tests/training/test_memory.py 2>&1 | tail -4 | tee $OUT/gpu_tests.txt
common="experiment=paper_0.5b data=local train.global_batch_tokens=16384 train.micro_batch=8 train.seq_len=2048 sparsity.l1_coef=1e-3 logging.log_interval=10 eval.interval=0 checkpoint.interval=0 optim.warmup_steps=20"
timeout 330 python3 scripts/race.py --out /tmp/race05 --settle 60 -- $common train.steps=${STEPS:-160} 2>&1 | tail -12
cp /tmp/race05/race.json /tmp/race05/race.md /tmp/race05/race.png $OUT/ 2>/dev/null
grep -E "memory estimate|warmed|FFN auto" /tmp/race05/sparse.log | tee $OUT/sparse_start.txt
for twin in sparse dense; do
  timeout 100 python3 .gpu/profile_steps.py /tmp/race05/$twin ${STEPS:-160} $common $([ $twin = dense ] && echo model.ffn_impl=dense || echo model.ffn_impl=auto) > $OUT/profile_$twin.txt 2>&1
  grep -E "resumed|wall per step|Self CUDA time total" $OUT/profile_$twin.txt
done
