#!/usr/bin/env bash
source docs/results/2026-12-07-c/head.sh
graph_tests 100 16
