"""The memory planner (training/memory.py) against the measured peak: a few eager steps of the real
trainer (train.py's build_trainer and Trainer.fit, each run in its own process) per model, FFN and
activation-checkpointing setting, torch.cuda.max_memory_allocated / max_memory_reserved over the steps
after the first, side by side with the plan.

    python scripts/bench_memory.py --out outputs/bench_memory            # 0.5b and 1.5b, dense and TwELL,
                                                                         # checkpointing off and on (8 runs)
    python scripts/bench_memory.py --out outputs/bench_memory_compiled --compile    # torch.compile'd blocks
    python scripts/bench_memory.py --out outputs/bench_memory_fsdp --parallel fsdp
    python scripts/bench_memory.py --out /tmp/bench_memory --quick -- data.path=... data.tokenizer=...

Eager steps by default (train.compile=false), --compile for blocks through torch.compile (the default of a
GPU run): the planner counts what each saves for its backward pass. One process, micro-batch 8 x
2048 tokens, grad_accum 1, bf16; --parallel fsdp runs FSDP2 over a one-rank mesh (bf16 gathers). The
TwELL runs start from a model calibrated to the paper's activity (model/calibrate.py: ~29 active units of
the FFN's per token; a fresh model has half its units active, which no trained sparse model has), so the
sparse state is the size the planner assumes; the measured activity is in the table. The first step is
left out of the peak (kernel autotuning, AdamW's moments made at its end).

The relative error is (plan - measured) / measured against the reserved peak (what the allocator holds:
the planner's fixed reserve covers its workspaces and fragmentation, and the CUDA context, which no
counter here sees); against the allocated peak the plan is taken without that reserve. --quick: the tiny
model on the CPU (no memory counters there: the table and JSON shape only, for the tests).
Data: data=local (`python scripts/prepare_offline_data.py`, run here when offline/ is missing).
Everything after `--` is extra Hydra overrides for every run. Writes <out>/bench_memory.json,
<out>/bench_memory.md and each run's log.
"""

from __future__ import annotations

import argparse
import json
import runpy
import sys
import time
from pathlib import Path

from bench_fsdp import FFN, TINY_CPU, calibrated_start, ensure_offline_data, launch, report
from plan_memory import compose_job
from race import split_extra

from twell.training.memory import GIB, RESERVE_BYTES, estimate_training_memory, job_settings

ROOT = Path(__file__).resolve().parents[1]
QUICK = TINY_CPU


def run_overrides(model: str, ffn: str, checkpointing: bool, args, run_dir: Path) -> list[str]:
    tokens = args.micro_batch * args.seq_len
    return [
        f"model={model}", "data=local", *FFN[ffn], f"train.parallel={args.parallel}",
        f"train.compile={str(args.compile).lower()}",
        f"train.activation_checkpointing={str(checkpointing).lower()}", "train.precision=bf16",
        f"train.micro_batch={args.micro_batch}", f"train.seq_len={args.seq_len}", f"train.global_batch_tokens={tokens}",
        f"train.steps={args.steps}", "optim.warmup_steps=1000", "logging.log_interval=1", "logging.console=false",
        "eval.interval=0", "checkpoint.interval=0", "checkpoint.save_final=false", "checkpoint.resume=none",
        f"run_name=bench_memory_{model}_{ffn}", f"run_dir={run_dir}", *(QUICK if args.quick else []), *args.extra,
    ]  # fmt: skip


def planned(job, checkpointing: bool) -> dict:
    settings = job_settings(job, world_size=1, sharded=job.train.parallel == "fsdp")
    est = estimate_training_memory(
        job.model,
        job.train.micro_batch,
        job.train.seq_len,
        activation_checkpointing=checkpointing,
        **settings,
    )
    return {"total_gib": est.total / GIB, **{part: getattr(est, part) / GIB for part in est.PARTS}}


# ---------------------------------------------------------------- one run (in its own process)
def measure(overrides: list[str], result_path: Path) -> None:
    """Build the trainer as train.py does and train; write the peaks of the steps after the first."""
    import torch

    entry = runpy.run_path(str(ROOT / "train.py"), run_name="twell_train_entry")
    job = compose_job(overrides)
    tcfg = job.train
    cuda = tcfg.device != "cpu" and torch.cuda.is_available()
    with calibrated_start(job):
        trainer = entry["build_trainer"](job)
    peaks = []
    log_window = trainer._log_window

    def log_and_read_peaks():  # the window's peaks, read before _log_window resets them for the next one
        if cuda:
            peaks.append((trainer.step, torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()))
        return log_window()

    trainer._log_window = log_and_read_peaks
    if cuda:
        torch.cuda.empty_cache()  # the model's initialisation leaves nothing cached: fit() resets the peaks
    start = time.perf_counter()
    records = [r for r in trainer.fit() if "loss" in r]
    later = [peak for peak in peaks if peak[0] > 1] or peaks
    result = {
        "peak_allocated_gib": max(p[1] for p in later) / GIB if later else None,
        "peak_reserved_gib": max(p[2] for p in later) / GIB if later else None,
        "active_mean": sum(records[-1]["active_mean"]) / len(records[-1]["active_mean"]),
        "loss": records[-1]["loss"],
        "steps": len(records),
        "train_s": time.perf_counter() - start,
    }
    result_path.write_text(json.dumps(result))


# ---------------------------------------------------------------- the table
def relative(plan: float, measured: float | None) -> float | None:
    return None if not measured else (plan - measured) / measured


def table(result: dict) -> str:
    fmt = lambda value, spec: "n/a" if value is None else format(value, spec)
    lines = [
        "| model | ffn | act. ckpt | plan GiB | reserved GiB | error | plan - reserve GiB | allocated GiB | "
        "error | active units | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["runs"]:
        plan = r["plan"]["total_gib"]
        lines.append(
            f"| {r['model']} | {r['ffn']} | {'on' if r['activation_checkpointing'] else 'off'} | {plan:.1f} | "
            f"{fmt(r['peak_reserved_gib'], '.1f')} | {fmt(r['error_reserved'], '+.1%')} | "
            f"{plan - RESERVE_BYTES / GIB:.1f} | {fmt(r['peak_allocated_gib'], '.1f')} | "
            f"{fmt(r['error_allocated'], '+.1%')} | {r['active_mean']:.1f} | {r['wall_s']:.0f} |"
        )
    lines += [
        "",
        f"{result['parallel']}, {result['blocks']} bf16, micro-batch {result['micro_batch']} x {result['seq_len']}, "
        f"{result['steps']} steps (peaks after the first); commit {result['commit']}, {result['machine']}",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv, extra = split_extra(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, help="folder for the table, the JSON and the runs")
    parser.add_argument("--models", nargs="+", default=["0.5b", "1.5b"])
    parser.add_argument("--ffn", nargs="+", default=["dense", "twell"], choices=sorted(FFN))
    parser.add_argument("--checkpointing", nargs="+", default=["off", "on"], choices=["off", "on"])
    parser.add_argument("--parallel", default="ddp", choices=["ddp", "fsdp"], help="ddp: the plain model")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=3, help="steps a run (the first is not measured)")
    parser.add_argument("--compile", action="store_true", help="blocks through torch.compile (default eager)")
    parser.add_argument("--quick", action="store_true", help="the tiny model on the CPU: the output's shape")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        measure(extra, args.child)
        return 0
    if args.out is None:
        parser.error("--out is required")
    if args.steps < 2:
        parser.error(f"--steps={args.steps} must be >= 2 (the first step is not measured)")
    if args.quick:
        args.models, args.micro_batch, args.seq_len = ["tiny"], 2, 32
    args.extra = extra
    ensure_offline_data(extra)
    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "parallel": "FSDP2 (one rank)" if args.parallel == "fsdp" else "one process",
        "micro_batch": args.micro_batch,
        "seq_len": args.seq_len,
        "blocks": "compiled" if args.compile else "eager",
        "steps": args.steps,
        "extra": extra,
        "runs": [],
    }
    for model in args.models:
        for ffn in args.ffn:
            for checkpointing in (setting == "on" for setting in args.checkpointing):
                name = f"{model}_{ffn}_{'ckpt' if checkpointing else 'no_ckpt'}"
                overrides = run_overrides(model, ffn, checkpointing, args, args.out / name)
                plan = planned(compose_job(overrides), checkpointing)
                print(f"{name}: plan {plan['total_gib']:.1f} GiB", end="", flush=True)
                child = [
                    sys.executable,
                    __file__,
                    "--child",
                    str(args.out / f"{name}.json"),
                    "--",
                    *overrides,
                ]
                wall = launch(child, args.out / f"{name}.log")
                run = json.loads((args.out / f"{name}.json").read_text())
                run.update(
                    model=model, ffn=ffn, activation_checkpointing=checkpointing, plan=plan, wall_s=wall,
                    error_reserved=relative(plan["total_gib"], run["peak_reserved_gib"]),
                    error_allocated=relative(plan["total_gib"] - RESERVE_BYTES / GIB, run["peak_allocated_gib"]),
                )  # fmt: skip
                result["runs"].append(run)
                measured = run["peak_reserved_gib"]
                said = (
                    "no GPU memory counters" if measured is None else f"measured {measured:.1f} GiB reserved"
                )
                print(f", {said} ({wall:.0f} s)", flush=True)
    report(args.out, "bench_memory", result, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
