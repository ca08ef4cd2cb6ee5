# Sourced by this session's call scripts: the shared start (docs/results/2026-12-05/common.sh's environment,
# the device's name) and bench NAME SECONDS SCRIPT ARGS...: one benchmark, time-limited, its output in
# $OUT/NAME.txt, its exit status, the call's elapsed seconds and the output's last lines printed.
set -uo pipefail
t0=$(date +%s)
source docs/results/2026-12-05/common.sh
printf 'setup %s s\n' "$(( $(date +%s) - t0 ))"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
bench() {
  local name=$1 limit=$2; shift 2
  timeout "$limit" python3 "$@" > "$OUT/$name.txt" 2>&1
  printf '%s rc %s t %s s\n' "$name" "$?" "$(( $(date +%s) - t0 ))"
  tail -"${TAIL:-12}" "$OUT/$name.txt"
}
