"""Plan a run's GPU memory before launching it: the expected peak per GPU of one training step, part by
part, for a dense and a TwELL (sparse) FFN with and without activation checkpointing, the largest
micro-batch that fits each, and what train.activation_checkpointing=auto will choose. The same model the
trainer uses at start (training/memory.py), for blocks compiled or eager as train.compile has them on a GPU
(auto: compiled, unless train.cuda_graph=true; `train.compile=false` plans an eager run, which saves more).

    python scripts/plan_memory.py experiment=paper_1.5b
    python scripts/plan_memory.py model=1.5b train.micro_batch=16 --gpu-gib 80 --world-size 8 --parallel fsdp

Arguments without dashes are the trainer's Hydra overrides (the same config tree as train.py).
--gpu-gib defaults to this machine's GPU, else 80 (an H100).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir

from twell.training.config import parse_job, register_configs
from twell.training.memory import (
    FIT_FRACTION,
    GIB,
    MemoryEstimate,
    choose_activation_checkpointing,
    estimate_training_memory,
    job_settings,
)

ROOT = Path(__file__).resolve().parents[1]
PARTS = MemoryEstimate.PARTS


def compose_job(overrides: list[str]):
    """The JobConfig that train.py builds from these Hydra overrides."""
    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
        return parse_job(compose("train", overrides=overrides))


def local_gpu_gib() -> float | None:
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(0).total_memory / GIB


def largest_micro_batch(cfg, seq_len: int, budget: float, limit: int = 4096, **kw) -> int:
    """The largest micro-batch (sequences) whose estimate fits `budget` bytes; 0 if not even one."""
    fits = lambda mb: estimate_training_memory(cfg, mb, seq_len, **kw).total <= budget
    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:  # fits(lo), not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def plan(job, gpu_gib: float, world_size: int, parallel: str) -> dict:
    """Per FFN (dense, TwELL) and activation-checkpointing setting: the estimate, part by part, and the
    largest micro-batch that fits. FSDP2 shards over every process, one included, as the trainer does."""
    mcfg, tcfg = job.model, job.train
    settings = job_settings(job, world_size, sharded=parallel == "fsdp")
    budget = FIT_FRACTION * gpu_gib * GIB
    rows = []
    for sparse in (False, True):
        for checkpointing in (False, True):
            kw = {**settings, "sparse_ffn": sparse, "activation_checkpointing": checkpointing}
            est = estimate_training_memory(mcfg, tcfg.micro_batch, tcfg.seq_len, **kw)
            rows.append({
                "ffn": "twell" if sparse else "dense",
                "activation_checkpointing": checkpointing,
                **{part: getattr(est, part) / GIB for part in PARTS},
                "total_gib": est.total / GIB,
                "fits": est.total <= budget,
                "largest_micro_batch": largest_micro_batch(mcfg, tcfg.seq_len, budget, **kw),
            })  # fmt: skip
    auto, _, _ = choose_activation_checkpointing(
        mcfg, tcfg.micro_batch, tcfg.seq_len, int(gpu_gib * GIB), **settings
    )
    return {
        "model": mcfg.name or f"d{mcfg.d_model} x {mcfg.n_layers} layers",
        "params": mcfg.num_params(),
        "micro_batch": tcfg.micro_batch,
        "seq_len": tcfg.seq_len,
        "world_size": world_size,
        "parallel": "fsdp" if parallel == "fsdp" else ("ddp" if world_size > 1 else "one process"),
        "gpu_gib": gpu_gib,
        "budget_gib": budget / GIB,
        "rows": rows,
        "ffn_impl": mcfg.ffn_impl,
        "compiled": settings["compiled"],
        "auto_activation_checkpointing": auto,
    }


def table(result: dict) -> str:
    head = (
        f"{result['model']} ({result['params'] / 1e9:.2f}B parameters), micro-batch {result['micro_batch']} x "
        f"{result['seq_len']}, {'compiled' if result['compiled'] else 'eager'} blocks, {result['world_size']} "
        f"GPU(s), {result['parallel']}; {result['gpu_gib']:.1f} GiB "
        f"per GPU, {result['budget_gib']:.1f} GiB usable ({FIT_FRACTION:.0%})"
    )
    lines = [
        head,
        "",
        "| FFN | act. ckpt | " + " | ".join(PARTS) + " | total GiB | fits | largest micro-batch |",
        "|---|---|" + "---|" * len(PARTS) + "---|---|---|",
    ]
    for r in result["rows"]:
        parts = " | ".join(f"{r[p]:.1f}" for p in PARTS)
        lines.append(
            f"| {r['ffn']} | {'on' if r['activation_checkpointing'] else 'off'} | {parts} | {r['total_gib']:.1f} | "
            f"{'yes' if r['fits'] else 'no'} | {r['largest_micro_batch']} |"
        )
    start = "dense (ffn_impl=auto starts dense)" if result["ffn_impl"] != "twell" else "TwELL"
    choice = "on" if result["auto_activation_checkpointing"] else "off"
    lines += ["", f"train.activation_checkpointing=auto: {choice} (estimated with the {start} FFN)"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "overrides", nargs="*", help="Hydra overrides, as for train.py (experiment=paper_1.5b ...)"
    )
    p.add_argument("--gpu-gib", type=float, help="memory per GPU in GiB (default: this GPU's, else 80)")
    p.add_argument("--world-size", type=int, default=1, help="data-parallel processes (default 1)")
    p.add_argument("--parallel", choices=("ddp", "fsdp"), help="default: the config's train.parallel")
    p.add_argument("--json", help="also write the plan to this file")
    args = p.parse_intermixed_args(argv)  # overrides before and after the options
    if args.world_size < 1:
        p.error(f"--world-size={args.world_size} must be >= 1")
    if args.gpu_gib is not None and not args.gpu_gib > 0:
        p.error(f"--gpu-gib={args.gpu_gib:g} must be > 0 (leave it out for this machine's GPU, else 80)")
    job = compose_job(args.overrides)
    gpu_gib = args.gpu_gib or local_gpu_gib() or 80.0
    result = plan(job, gpu_gib, args.world_size, args.parallel or job.train.parallel)
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
