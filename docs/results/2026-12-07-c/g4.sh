#!/usr/bin/env bash
source docs/results/2026-12-07-c/head.sh
graph_tests
for c in true false; do
  TWELL_PROBE=1 PYTHONPATH=$PWD/docs/results/2026-12-07-c/probe:$PYTHONPATH timeout 150 python3 train.py experiment=paper_0.5b $RACE_16K train.steps=70 \
    model.ffn_impl=auto train.twell_graphs=true train.compile=$c run_name=p$c run_dir=/tmp/p$c > $OUT/probe_$c.txt 2>&1
  echo "compile=$c rc $? t $(( $(date +%s) - t0 )) s"; grep PROBE $OUT/probe_$c.txt | cut -c1-800; grep -v PROBE $OUT/probe_$c.txt | tail -2 | cut -c1-300
done
echo "total $(( $(date +%s) - t0 )) s"
