#!/usr/bin/env bash
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit
mkdir -p /tmp/twell_ns/twell; for p in kernels model data training eval; do ln -sfn $PWD/$p /tmp/twell_ns/twell/$p; done
export PYTHONPATH=/tmp/twell_ns:$PYTHONPATH PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false
python3 scripts/prepare_offline_data.py > $OUT/prep.txt 2>&1 || { tail $OUT/prep.txt; exit 1; }
common="experiment=paper_0.5b data=local train.global_batch_tokens=16384 train.micro_batch=8 train.seq_len=2048 sparsity.l1_coef=1e-3 logging.log_interval=10 eval.interval=0 checkpoint.interval=0 checkpoint.save_final=false optim.warmup_steps=20 train.steps=130"
timeout 300 python3 scripts/race.py --out /tmp/rw --settle 60 -- $common 2>&1 | tail -6
mkdir -p /tmp/rc && cp -r /tmp/rw/dense /tmp/rc/dense
timeout 170 python3 scripts/race.py --out /tmp/rc --settle 60 --only sparse -- $common train.warm_up=false 2>&1 | tail -6
for d in rw rc; do cp /tmp/$d/race.json $OUT/$d.json; cp /tmp/$d/race.md $OUT/$d.md; cp /tmp/$d/race.png $OUT/$d.png; done
grep -hE "warmed|FFN auto|estimate" /tmp/rw/sparse.log /tmp/rc/sparse.log | cut -c1-200
