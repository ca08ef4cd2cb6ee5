#!/usr/bin/env bash
source docs/results/2026-12-07-c/head.sh
source docs/results/2026-12-06-b/race_ab.sh
graph_tests
race_ab 0.5b 130
echo "t $(( $(date +%s) - t0 )) s"
race_ab 1.5b $(( 500 - ($(date +%s) - t0) ))
echo "total $(( $(date +%s) - t0 )) s"
