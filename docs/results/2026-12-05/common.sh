# sourced by the call scripts: offline wheels, the twell namespace, offline data
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1 || { echo "wheel install failed"; exit 1; }
mkdir -p /tmp/twell_ns/twell; for p in kernels model data training eval; do ln -sfn $PWD/$p /tmp/twell_ns/twell/$p; done
export PYTHONPATH=/tmp/twell_ns:/tmp/site:$PWD/scripts PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false
export TRITON_CACHE_DIR=/tmp/triton_cache
[ -d offline/sample ] || python3 scripts/prepare_offline_data.py > $OUT/prep.txt 2>&1 || { tail $OUT/prep.txt; exit 1; }
# the races' and profiles' overrides besides the experiment: 16k-token steps of the offline sample, L1 1e-3
RACE_16K="data=local train.global_batch_tokens=16384 train.micro_batch=8 train.seq_len=2048 sparsity.l1_coef=1e-3 logging.log_interval=10 eval.interval=0 checkpoint.interval=0 checkpoint.save_final=false optim.warmup_steps=20"
