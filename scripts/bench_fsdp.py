"""FSDP2 against plain training on this machine's GPUs: the same compiled run through the real trainer
(train.py under torchrun), once with train.parallel=ddp (one process: the plain model) and once with
train.parallel=fsdp (FSDP2 over a one-rank mesh: bf16 gathers, fp32 reduction and masters), then
tokens/s, peak memory and the loss side by side. What FSDP2 itself costs, with no peer to wait for.

    python scripts/bench_fsdp.py --out outputs/bench_fsdp                     # 0.5b, dense, 30 steps
    python scripts/bench_fsdp.py --out outputs/bench_fsdp --ffn dense twell --model 1.5b
    python scripts/bench_fsdp.py --out outputs/bench_fsdp --variants plain fsdp fsdp_keep -- train.micro_batch=4

Data: data=local (`python scripts/prepare_offline_data.py`, run here when offline/ is missing). Steps of
2 micro-batches of 8 x 2048 tokens (grad_accum 2: FSDP2's unsynchronised micro-batch is in the step).
"steady" is the median tokens/s of the logging windows after --settle steps (compile and autotuning
happen before). The TwELL runs start from weights calibrated to the paper's activity (model/calibrate.py:
~29 active units a token; a fresh model has half its units active, where no trained sparse model is), on
both sides alike, and train at a learning rate of 1e-12 so that it stays there (FFN); the table gives the
mean activity of each run's last window. Writes
<out>/bench_fsdp.json, <out>/bench_fsdp.md and each run's log and metrics. --quick: the tiny model on the
CPU (gloo), the output's shape. Everything after `--` is extra Hydra overrides for every run.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import runpy
import statistics
import subprocess
import sys
import time
from pathlib import Path

from plan_memory import compose_job
from race import commit_of, machine_name, read_records, split_extra

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN_ONE = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]
VARIANTS = {
    "plain": ["train.parallel=ddp"],
    "fsdp": ["train.parallel=fsdp"],
    # every block's gathered bf16 parameters held from its forward to its backward: one gather a micro-batch
    # (what auto does on one rank)
    "fsdp_keep": ["train.parallel=fsdp", "train.fsdp_reshard_after_forward=false"],
    # every block gathered again for its backward (what auto does on several ranks, but for the last block)
    "fsdp_reshard": ["train.parallel=fsdp", "train.fsdp_reshard_after_forward=true"],
    "fsdp_no_prefetch": ["train.parallel=fsdp", "train.fsdp_prefetch=0"],
}
FFN = {
    "dense": ["model.ffn_impl=dense", "sparsity=dense"],
    # A calibrated model (calibrated_start) is no trained one: at the schedule's rates its activity
    # climbs away (1.5b: 29 -> 2,300 units a token in 24 steps at optim.warmup_steps=1000; H100, 2026-12-07),
    # so the TwELL runs train at a learning rate that leaves it where the calibration put it.
    "twell": ["model.ffn_impl=twell", "sparsity=paper", "optim.lr=1e-12"],
}
# Sequences of the job's text that calibrated_start calibrates on: the thresholds fit other text the less
# well the deeper the layer and the fewer tokens they were set on (on 4 sequences the 1.5b's last layers
# fired at ~290 units a token against 29; docs/results/2026-12-07-e/README.md).
CALIBRATION_SEQUENCES = 32
# The bench scripts' --quick model: the tiny preset cut to what a 2-core CPU trains in seconds
TINY_CPU = [
    "model.d_model=64",
    "model.n_heads=2",
    "model.d_ff=128",
    "model.max_seq_len=64",
    "train.device=cpu",
]
# --quick: that model, two micro-batches of 2 x 32 tokens a step
QUICK = [
    *TINY_CPU, "train.compile=false", "train.micro_batch=2", "train.seq_len=32", "train.global_batch_tokens=128",
    "logging.log_interval=2",
]  # fmt: skip


def run_overrides(model: str, ffn: str, variant: str, steps: int, run_dir: Path) -> list[str]:
    return [
        f"model={model}", "data=local", *FFN[ffn], *VARIANTS[variant], "train.compile=true",
        "train.activation_checkpointing=false", "train.precision=bf16", "train.micro_batch=8", "train.seq_len=2048",
        "train.global_batch_tokens=32768", f"train.steps={steps}", "optim.warmup_steps=10", "logging.log_interval=5",
        "logging.console=false", "eval.interval=0", "checkpoint.interval=0", "checkpoint.save_final=false",
        "checkpoint.resume=none", f"run_name=bench_fsdp_{ffn}_{variant}", f"run_dir={run_dir}",
    ]  # fmt: skip


@contextlib.contextmanager
def calibrated_start(job):
    """While open, a TwELL job's model (model.ffn_impl=twell) is initialised and then calibrated to the
    paper's activity (model/calibrate.py) on a batch of the job's own training text, as train.py's
    build_trainer initialises it (before sharding it under FSDP2); any other job's model as usual."""
    from twell.model.transformer import Transformer

    if job.model.ffn_impl != "twell":
        yield
        return

    import torch

    from twell.data import build_train_stream, load_tokenizer
    from twell.data.token_shards import apply_corpus_defaults
    from twell.model.calibrate import calibrate_activity

    init_weights = Transformer.init_weights

    def init_then_calibrate(model):
        init_weights(model)
        if model.tok_embeddings.weight.is_meta:  # the constructor's own call, on the meta device
            return
        apply_corpus_defaults(job.data)
        tokenizer = load_tokenizer(job.data.tokenizer)
        # One batch is read: no read-ahead thread (data.prefetch) making batches nobody takes.
        stream = build_train_stream(
            dataclasses.replace(job.data, prefetch=0), tokenizer, job.train.seq_len, CALIBRATION_SEQUENCES,
            0, 1, 1, job.train.seed + 1,
        )  # fmt: skip
        with torch.no_grad():
            calibrate_activity(model, next(stream)["input_ids"])
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the calibration's activations are not the run's memory

    Transformer.init_weights = init_then_calibrate
    try:
        yield
    finally:
        Transformer.init_weights = init_weights


def train_child(overrides: list[str]) -> None:
    """train.py as its own script (Hydra, run, exit status) on `overrides`, under torchrun, its model
    started by calibrated_start."""
    job = compose_job(overrides)  # leaves no Hydra state behind for train.py's own composition
    sys.argv = [str(ROOT / "train.py"), *overrides]
    with calibrated_start(job):
        runpy.run_path(sys.argv[0], run_name="__main__")


def ensure_offline_data(extra: list[str]) -> None:
    """Build the offline sample (data=local) unless it is there or the overrides name other data."""
    if not any(o.startswith("data.") for o in extra) and not (ROOT / "offline" / "tokenizer").exists():
        subprocess.run([sys.executable, str(ROOT / "scripts" / "prepare_offline_data.py")], check=True)


def launch(command: list[str], log_path: Path) -> float:
    """Run `command` with its output in log_path; returns its wall seconds (start-up and compile included)."""
    start = time.perf_counter()
    with open(log_path, "w") as log:
        done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT)
    if done.returncode:
        tail = log_path.read_text()[-3000:]
        raise SystemExit(f"run failed (exit {done.returncode}); the end of {log_path}:\n{tail}")
    return time.perf_counter() - start


def report(out: Path, name: str, result: dict, table) -> None:
    """Add the commit and the machine to `result`, print table(result) and write it to <out>/<name>.md,
    the result to <out>/<name>.json."""
    result.update(commit=commit_of(ROOT), machine=machine_name())
    text = table(result)
    print(text)
    (out / f"{name}.md").write_text(text)
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))


def summarize(records: list[dict], settle: int, wall_s: float) -> dict:
    after = [r["tokens_per_s"] for r in records if r["step"] > settle] or [records[-1]["tokens_per_s"]]
    return {
        "steady_tokens_per_s": statistics.median(after),
        "windows": [r["tokens_per_s"] for r in records],
        "peak_mem_gib": max(r["peak_mem_gib"] or 0.0 for r in records),
        "final_loss": records[-1]["loss"],
        "active_mean": statistics.fmean(records[-1].get("active_mean") or [float("nan")]),
        "wall_s": wall_s,
    }


def table(result: dict) -> str:
    rows = [
        "| ffn | run | steady tokens/s | vs plain | peak GiB | loss at last step | active units | wall s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for ffn, runs in result["runs"].items():
        base = runs.get("plain", {}).get("steady_tokens_per_s")
        for name, s in runs.items():
            ratio = f"{s['steady_tokens_per_s'] / base:.3f}x" if base else "n/a"
            rows.append(
                f"| {ffn} | {name} | {s['steady_tokens_per_s']:,.0f} | {ratio} | {s['peak_mem_gib']:.1f} | "
                f"{s['final_loss']:.4f} | {s['active_mean']:.1f} | {s['wall_s']:.0f} |"
            )
    rows.append("")
    rows.append(
        f"model {result['model']}, {result['steps']} steps; commit {result['commit']}, {result['machine']}"
    )
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv, extra = split_extra(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, help="folder for the table, the JSON and the runs")
    parser.add_argument("--model", default="0.5b")
    parser.add_argument("--ffn", nargs="+", default=["dense"], choices=sorted(FFN))
    parser.add_argument("--variants", nargs="+", default=["plain", "fsdp"], choices=list(VARIANTS))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--settle", type=int, default=10, help="steps left out of the steady speed")
    parser.add_argument("--quick", action="store_true", help="the tiny model on the CPU: the output's shape")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        train_child(extra)
        return 0
    if args.out is None:
        parser.error("--out is required")
    if args.quick:
        args.model, extra = "tiny", [*QUICK, *extra]
    ensure_offline_data(extra)
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"model": args.model, "steps": args.steps, "settle": args.settle, "extra": extra, "runs": {}}
    for ffn in args.ffn:
        result["runs"][ffn] = {}
        for variant in args.variants:
            run_dir = args.out / f"{ffn}_{variant}"
            overrides = [*run_overrides(args.model, ffn, variant, args.steps, run_dir), *extra]
            print(
                f"{ffn} / {variant}: torchrun --nproc_per_node=1 train.py {' '.join(overrides)}", flush=True
            )
            wall = launch(
                [*TORCHRUN_ONE, __file__, "--child", "--", *overrides], args.out / f"{ffn}_{variant}.log"
            )
            summary = summarize(read_records(run_dir), args.settle, wall)
            result["runs"][ffn][variant] = summary
            print(f"  steady {summary['steady_tokens_per_s']:,.0f} tokens/s, {wall:.0f} s", flush=True)
    report(args.out, "bench_fsdp", result, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
