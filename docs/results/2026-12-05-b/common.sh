# sourced by the call scripts: offline wheels, the twell namespace, offline data
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1 || { echo "wheel install failed"; exit 1; }
mkdir -p /tmp/twell_ns/twell; for p in kernels model data training eval; do ln -sfn $PWD/$p /tmp/twell_ns/twell/$p; done
export PYTHONPATH=/tmp/twell_ns:/tmp/site:$PWD/scripts PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false
export TRITON_CACHE_DIR=/tmp/triton_cache
[ -d offline/sample ] || python3 scripts/prepare_offline_data.py > $OUT/prep.txt 2>&1 || { tail $OUT/prep.txt; exit 1; }
