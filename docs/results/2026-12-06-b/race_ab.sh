#!/usr/bin/env bash
# Sourced by the call scripts: race_ab SIZE SECONDS: the race of experiment=paper_SIZE (16k-token steps,
# 100 steps), the sparse twin with the per-layer op graphs on as a third run, cut at SECONDS (the table
# then comes from the runs that finished); prints the table and each run's speed and graph counters.
race_ab() {
  local size=$1 limit=$2 dir=/tmp/r$1
  local args=(--out $dir --settle 50 --variant op_graphs "train.twell_graphs=true")
  timeout -k 10 $limit python3 scripts/race.py "${args[@]}" -- experiment=paper_$size $RACE_16K train.steps=100 > $OUT/race_$size.txt 2>&1
  local rc=$?; echo "race $size rc $rc"
  [ $rc -eq 0 ] || python3 scripts/race.py "${args[@]}" --no-run >> $OUT/race_$size.txt 2>&1
  tail -7 $OUT/race_$size.txt
  DIR=$dir python3 - <<'PY'
import glob, json, os
for f in sorted(glob.glob(os.environ["DIR"] + "/*/metrics.jsonl")):
    for line in open(f):
        r = json.loads(line)
        if "tokens_per_s" in r and r["step"] % 20 == 0:
            print(f.split("/")[-2], r["step"], round(r["tokens_per_s"]), {k[12:]: v for k, v in r.items() if k.startswith("twell_graph_")})
PY
  grep -h "failed (" $dir/*.log | sort | uniq -c | head -3 | cut -c1-300
  tar -czf $OUT/race_$size.tgz --exclude=checkpoints -C /tmp r$size 2>/dev/null
}
