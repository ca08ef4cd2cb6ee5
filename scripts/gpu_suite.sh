#!/usr/bin/env bash
# Everything we check and time on a GPU node, in one call (our H200 lease is short):
#   bash scripts/gpu_suite.sh kernels baselines      # stages: kernels baselines model fidelity sweep gputests decode profile hot memory dist
# Results (tables, JSON, logs) go to $OUT (default outputs/gpu). On an offline node the missing
# pure-Python packages travel as wheels in .whl/ (../shared/device/wheels.sh fills it).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-outputs/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false
if [ -d .whl ] && ! python3 -c "import hydra, datasets" >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
if ! python3 -c "import twell.kernels" >/dev/null 2>&1; then
  # Not installed (a bare node): the twell namespace as links to this checkout's folders.
  mkdir -p /tmp/twell_ns/twell
  for part in kernels model data training eval; do ln -sfn "$PWD/$part" "/tmp/twell_ns/twell/$part"; done
  export PYTHONPATH=/tmp/twell_ns:${PYTHONPATH:-}
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw,temperature.gpu --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

stage_kernels() {
  stage_gputests
  python3 scripts/bench_gate.py --out "$OUT/bench_gate.json" 2>&1 | tee "$OUT/bench_gate.txt"
  python3 scripts/bench_ffn.py --d-ff 5632 --out "$OUT/bench_ffn.json" 2>&1 | tee "$OUT/bench_ffn.txt"
  python3 scripts/bench_ffn.py --tokens 1 64 131072 --d-ff 8192 --out "$OUT/bench_ffn_8192.json" 2>&1 | tee "$OUT/bench_ffn_8192.txt"
  python3 scripts/bench_train.py --cuda-graph --out "$OUT/bench_train.json" 2>&1 | tee "$OUT/bench_train.txt"
}

# Dense baselines of issue 2: one micro-batch of 8 x 2048 per step, bf16, fused AdamW, SDPA.
stage_baselines() {
  python3 scripts/prepare_offline_data.py >/dev/null
  for preset in 0.5b 1.5b; do
    for compile in false true; do
      name="baseline_${preset}_compile_${compile}"
      python3 train.py model=$preset sparsity=dense train.compile=$compile train.steps=40 \
        train.global_batch_tokens=16384 train.micro_batch=8 train.seq_len=2048 optim.warmup_steps=10 \
        checkpoint.interval=0 checkpoint.save_final=false eval.interval=0 logging.log_interval=10 \
        run_name=$name run_dir="$OUT/$name" 2>&1 | grep -v "it/s\]" | tail -6
    done
  done
}

# The whole model, dense FFNs against TwELL (the paper's Speed table): inference 64 x 2048, training
# steps of 8 x 2048 eager and graphed, energy per token; random weights calibrated to the paper's activity.
stage_model() {
  python3 scripts/bench_model.py --model 0.5b --compile --cuda-graph --out "$OUT/bench_model_0.5b.json" 2>&1 | tee "$OUT/bench_model_0.5b.txt"
  python3 scripts/bench_model.py --model 1.5b --cuda-graph --out "$OUT/bench_model_1.5b.json" 2>&1 | tee "$OUT/bench_model_1.5b.txt"
}

# Issue 5's fidelity pair (scripts/sweeps/fidelity_pair.txt) through the sweep stage: both runs, the
# comparison, plots, and the sparse model's activity and real FFN inputs with the kernels timed on
# layers 00, 05 and 11. SWEEP_ARGS still adds overrides to both runs.
stage_fidelity() {
  SWEEP=scripts/sweeps/fidelity_pair.txt SWEEP_DUMP=${SWEEP_DUMP:-fid_sparse} SWEEP_LAYERS=${SWEEP_LAYERS:-00 05 11} \
    stage_sweep
}

# A set of training runs side by side, several per GPU: SWEEP names a file of lines
# "name gpu overrides..." (scripts/sweeps/; gpu is taken modulo the node's GPU count, so a spec for
# two GPUs also runs on one); every run gets experiment=fidelity, SWEEP_ARGS and its own
# overrides, and at most SWEEP_SECONDS of wall time. Then a comparison table (scripts/compare_runs.py),
# each run's activity plot, and for each run in SWEEP_DUMP its activity on held-out text with its FFN
# inputs dumped ($RUNS) and the TwELL kernels timed on layers SWEEP_LAYERS of them.
stage_sweep() {
  [ -d offline/corpus ] || { echo "offline/corpus missing: run scripts/build_corpus.py and carry it"; return 1; }
  local spec=${SWEEP:-scripts/sweeps/fidelity_sparsity.txt} RUNS=${RUNS:-/tmp/twell_runs} names=()
  local gpus
  gpus=$(python3 -c "import torch; print(max(1, torch.cuda.device_count()))")
  mkdir -p "$RUNS" "$OUT/sweep"
  while read -r name gpu overrides; do
    case "$name" in ''|'#'*) continue ;; esac
    names+=("$name")
    CUDA_VISIBLE_DEVICES=$((gpu % gpus)) timeout --signal=TERM "${SWEEP_SECONDS:-450}" python3 train.py experiment=fidelity \
      run_name="$name" run_dir="$RUNS/$name" ${SWEEP_ARGS:-} $overrides > "$RUNS/$name.log" 2>&1 &
  done < "$spec"
  wait
  for name in "${names[@]}"; do
    tr '\r' '\n' < "$RUNS/$name.log" | grep -E "^(Traceback|[A-Za-z]*Error)" | head -3
    cp "$RUNS/$name/metrics.jsonl" "$OUT/sweep/${name}_metrics.jsonl"
    python3 scripts/plot_activity.py "$RUNS/$name" --out "$OUT/sweep/${name}_activity.png"
  done
  (cd "$RUNS" && python3 "$OLDPWD/scripts/compare_runs.py" "${names[@]}" --out "$OUT/sweep/compare.json") \
    | tee "$OUT/sweep/compare.txt"
  for name in ${SWEEP_DUMP:-}; do
    python3 scripts/activity.py checkpoint="$RUNS/$name/checkpoints" --val-rows 64 --data corpus \
      --out "$OUT/sweep/${name}_text" --dump-ffn-inputs "$RUNS/${name}_ffn.pt" --layers all 2>&1 | tail -16
    for layer in ${SWEEP_LAYERS:-00 05 11}; do
      python3 scripts/bench_ffn.py --activations "$RUNS/${name}_ffn.layer$layer.pt" --hot-units 0 256 \
        --out "$OUT/sweep/${name}_bench_ffn_l$layer.json" 2>&1 | tail -4
      python3 scripts/bench_train.py --activations "$RUNS/${name}_ffn.layer$layer.pt" --tokens 16384 --no-compile \
        --out "$OUT/sweep/${name}_bench_train_l$layer.json" 2>&1 | grep -v "^wrote"
    done | tee "$OUT/sweep/${name}_bench_real.txt"
  done
}

# GPU-marked tests only (correctness at real sizes), and the decode sizes of bench_ffn under CUDA graphs.
stage_prefix() {  # the hot prefix (units stored most-firing first, the first P dense) against csr alone
  python3 scripts/bench_ffn.py --tokens 16384 131072 --schedules csr --hot-units 0 --hot-prefix 256 512 --graph-all \
    --out "$OUT/bench_prefix.json" 2>&1 | tee "$OUT/bench_prefix.txt"
  for p in 0 512; do
    python3 scripts/bench_model.py --model 0.5b --mode infer --compile --hot-prefix $p \
      --out "$OUT/bench_model_0.5b_p$p.json" 2>&1 | tee "$OUT/bench_model_0.5b_p$p.txt"
  done
}

stage_gatedup() {  # the prefix's gated GEMM through TMA or pointer loads, alone and inside the FFN
  timeout 300 python3 scripts/bench_prefix.py --out "$OUT/bench_prefix_loads.json" 2>&1 | tee "$OUT/bench_prefix_loads.txt"
  timeout 200 python3 -m pytest -q tests/kernels/inference/test_prefix.py tests/kernels/training/test_rowfwd.py 2>&1 | tail -3
}

stage_gputests() {
  python3 -m pytest -q -m gpu tests/kernels tests/model 2>&1 | tail -8 | tee "$OUT/gpu_tests.txt"
}
stage_decode() {
  python3 scripts/bench_ffn.py --tokens 1 4 16 64 --d-ff 5632 8192 --out "$OUT/bench_decode.json" 2>&1 \
    | tee "$OUT/bench_decode.txt"
}

# Where the time goes: per-kernel GPU times and wall time of one call of each inference variant
# (decode, 16k and 131k tokens) and of one training step at 16k tokens.
stage_profile() {
  python3 scripts/bench_ffn.py --tokens 1 64 16384 131072 --hot-units 0 1024 --rep 25 --profile \
    --out "$OUT/profile_ffn.json" 2>&1 | tee "$OUT/profile_ffn.txt"
  python3 scripts/bench_train.py --quick --no-compile --profile --out "$OUT/profile_train.json" 2>&1 \
    | tee "$OUT/profile_train.txt"
}

# Where the hot-unit split starts to pay: row schedule with K = 0 / 512 / 1024 dense hot units.
stage_hot() {
  python3 scripts/bench_ffn.py --tokens 4096 8192 16384 32768 65536 131072 --hot-units 0 512 1024 --rep 25 \
    --out "$OUT/bench_hot.json" 2>&1 | tee "$OUT/bench_hot.txt"
}

# The memory planner (training/memory.py) against the peaks of real trainer steps: 0.5b and 1.5b, dense
# and TwELL, activation checkpointing off and on, eager and compiled blocks (16 short runs).
stage_memory() {
  python3 scripts/bench_memory.py --out "$OUT/memory_eager" 2>&1 | tee "$OUT/memory_eager.txt"
  python3 scripts/bench_memory.py --out "$OUT/memory_compiled" --compile 2>&1 | tee "$OUT/memory_compiled.txt"
}

# Data parallelism on 2+ GPUs (NCCL): the fidelity model for a few steps under DDP and FSDP2 (same
# tokens: losses should agree to bf16 noise, FSDP2's peak memory lower), and FSDP2 with the TwELL
# training op in every layer.
stage_dist() {
  local RUNS=${RUNS:-/tmp/twell_runs} gpus
  gpus=${DIST_PROCS:-$(python3 -c "import torch; print(torch.cuda.device_count())")}
  [ "$gpus" -ge 2 ] || { echo "stage dist needs 2+ GPUs (found $gpus)"; return 1; }
  local common="experiment=fidelity train.steps=${DIST_STEPS:-20} train.global_batch_tokens=65536 train.micro_batch=16
    train.compile=false optim.warmup_steps=10 logging.log_interval=5 eval.interval=${DIST_STEPS:-20} eval.val_batches=4
    checkpoint.interval=0 checkpoint.save_final=false checkpoint.resume=none"
  mkdir -p "$OUT/dist" "$RUNS"
  for run in "ddp:train.parallel=ddp" "fsdp:train.parallel=fsdp" "fsdp_twell:train.parallel=fsdp model.ffn_impl=twell"; do
    name=gpu_${run%%:*}
    timeout "${DIST_SECONDS:-90}" torchrun --standalone --nproc_per_node "$gpus" train.py $common ${run#*:} \
      run_name=$name run_dir="$RUNS/$name" ${DIST_ARGS:-} > "$RUNS/$name.log" 2>&1
    echo "$name: exit $?"; tr '\r' '\n' < "$RUNS/$name.log" | grep -E "FSDP2|DDP|grad_accum|Error|error" | head -4
    cp "$RUNS/$name/metrics.jsonl" "$OUT/dist/${name}_metrics.jsonl" 2>/dev/null
  done
  (cd "$RUNS" && python3 "$OLDPWD/scripts/compare_runs.py" gpu_ddp gpu_fsdp gpu_fsdp_twell) | tee "$OUT/dist/compare.txt"
  python3 - "$OUT/dist" <<'PY'
import json, sys, pathlib
for name in ("gpu_ddp", "gpu_fsdp", "gpu_fsdp_twell"):
    path = pathlib.Path(sys.argv[1]) / f"{name}_metrics.jsonl"
    if not path.exists():
        continue
    rows = [json.loads(line) for line in path.read_text().splitlines() if '"ce"' in line]
    print(name, [(r["step"], round(r["loss"], 4), round(r.get("grad_norm") or 0.0, 3)) for r in rows],
          "peak GiB", round(rows[-1].get("peak_mem_gib") or 0.0, 2), "tok/s", round(rows[-1].get("tokens_per_s") or 0))
PY
}

for stage in "${@:-kernels}"; do
  echo "=== $stage"
  "stage_$stage"
done
