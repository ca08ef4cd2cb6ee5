#!/usr/bin/env bash
# Train on every GPU of this machine: one process per GPU through torchrun (rendezvous on this host).
#
#   bash scripts/launch/single_node.sh experiment=paper_1.5b                      # DDP
#   bash scripts/launch/single_node.sh experiment=paper_1.5b train.parallel=fsdp  # FSDP2
#   GPUS=4 bash scripts/launch/single_node.sh experiment=paper_0.5b               # 4 of the GPUs
#   DRY_RUN=1 bash scripts/launch/single_node.sh ...                              # print the command only
#
# Arguments are train.py's Hydra overrides. GPUS defaults to the GPUs nvidia-smi lists (1 without any:
# one CPU process). PYTHON picks the interpreter (default python3): torchrun runs as `python -m
# torch.distributed.run`, so it is the torch of that environment. Several nodes: scripts/launch/slurm.sbatch.
# Relative paths in the overrides (run_dir, data.path, ...) are taken from the folder you run it in, as
# with `python train.py`.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PY=${PYTHON:-python3}

count_gpus() {
    local n
    n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU') || true
    echo "${n:-0}"
}
GPUS=${GPUS:-$(count_gpus)}
((GPUS > 0)) || GPUS=1

cmd=("$PY" -m torch.distributed.run --standalone --nnodes=1 --nproc_per_node="$GPUS" "$ROOT/train.py" "$@")
if [[ "${DRY_RUN:-0}" == 1 ]]; then
    printf '%q ' "${cmd[@]}"
    echo
    exit 0
fi
exec "${cmd[@]}"
