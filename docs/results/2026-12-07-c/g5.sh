#!/usr/bin/env bash
source docs/results/2026-12-07-c/head.sh
graph_tests
TWELL_PROBE=1 PYTHONPATH=$PWD/docs/results/2026-12-07-c/probe:$PYTHONPATH timeout 100 python3 train.py experiment=paper_0.5b $RACE_16K train.steps=70 \
    model.ffn_impl=auto train.twell_graphs=true train.compile=false run_name=pf run_dir=/tmp/pf > $OUT/probe_false.txt 2>&1
echo "rc $? t $(( $(date +%s) - t0 )) s"; grep PROBE $OUT/probe_false.txt | cut -c1-900; grep -v PROBE $OUT/probe_false.txt | tail -1 | cut -c1-300
echo "total $(( $(date +%s) - t0 )) s"
