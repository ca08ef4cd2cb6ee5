#!/usr/bin/env bash
source docs/results/2026-12-07-c/head.sh
graph_tests 100 8
cp kernels/training/train_graph.py /tmp/new_tg.py; git show 08af0cd:kernels/training/train_graph.py > kernels/training/train_graph.py  # the call carried it as probe/old_tg.py
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/kernels/training/test_train_graph.py -k "without_cold" > $OUT/gpu_test_old.txt 2>&1
echo "the new test on 08af0cd's train_graph.py: rc $?"; grep -E "passed|failed|^E " $OUT/gpu_test_old.txt | head -4
cp /tmp/new_tg.py kernels/training/train_graph.py
