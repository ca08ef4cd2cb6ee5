"""The race: the sparse model and its dense twin trained by the real trainer (train.py) on the same
tokens with the same L1 coefficient, one after the other on this machine, then compared.

    python scripts/race.py --out outputs/race -- experiment=paper_0.5b data=local train.steps=200 \\
        train.global_batch_tokens=16384 sparsity.l1_coef=1e-3 eval.interval=0 checkpoint.interval=0

Everything after `--` is Hydra overrides for both runs; the sparse run adds model.ffn_impl=auto (the
paper recipe's default) and the dense twin model.ffn_impl=dense. Writes <out>/race.json, <out>/race.md
(the table) and <out>/race.png: CE against tokens and against wall-clock seconds, tokens/s over steps,
active units per token per layer over the sparse run's steps.

Speeds are per logging window (metrics.jsonl). "steady" is the median window after --settle steps (the
compile, the warm-up and the switch to the sparse path happen before it); "slowest" is the slowest window
after step 20 against that median, the cost of the switch a user sees. The CE gap is the sparse run's CE
against the dense twin's at the same step, worst over the logged steps after --settle.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TWINS = {"sparse": "model.ffn_impl=auto", "dense": "model.ffn_impl=dense"}


def read_records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: the run wrote no metrics (see its log beside it)")
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in records if "ce" in r and "tokens_per_s" in r]


def with_wall_clock(records: list[dict]) -> list[dict]:
    """Each record's cumulative training seconds: the window's tokens over its tokens/s, summed."""
    seconds, tokens = 0.0, 0
    out = []
    for r in records:
        seconds += (r["tokens"] - tokens) / r["tokens_per_s"]
        tokens = r["tokens"]
        out.append({**r, "seconds": seconds})
    return out


def summarize(records: list[dict], settle: int) -> dict:
    after = [r["tokens_per_s"] for r in records if r["step"] > settle] or [records[-1]["tokens_per_s"]]
    steady = statistics.median(after)
    late = [r["tokens_per_s"] for r in records if r["step"] > 20] or after
    return {
        "steady_tokens_per_s": steady,
        "slowest_window_after_20": min(late) / steady,
        "final_ce": records[-1]["ce"],
        "seconds": records[-1]["seconds"],
        "tokens": records[-1]["tokens"],
        "mean_active": sum(records[-1]["active_mean"]) / len(records[-1]["active_mean"]),
        "max_grad_norm_after_settle": max(
            (r["grad_norm"] for r in records if r["step"] > settle), default=records[-1]["grad_norm"]
        ),
    }


def compare(runs: dict[str, list[dict]], settle: int) -> dict:
    sparse, dense = runs["sparse"], runs["dense"]
    dense_ce = {r["step"]: r["ce"] for r in dense}
    gaps = [(r["ce"] - dense_ce[r["step"]]) / dense_ce[r["step"]] for r in sparse if r["step"] in dense_ce]
    late_gaps = [g for r, g in zip(sparse, gaps) if r["step"] > settle] or gaps
    summary = {name: summarize(records, settle) for name, records in runs.items()}
    return {
        **summary,
        "speedup": summary["sparse"]["steady_tokens_per_s"] / summary["dense"]["steady_tokens_per_s"],
        "worst_ce_gap_after_settle": max(late_gaps, key=abs) if late_gaps else None,
        "final_ce_gap": gaps[-1] if gaps else None,
    }


def table(result: dict) -> str:
    rows = [
        "| run | steady tokens/s | slowest window after step 20 | final CE | mean active units | max grad norm | seconds |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in TWINS:
        s = result[name]
        rows.append(
            f"| {name} | {s['steady_tokens_per_s']:,.0f} | {s['slowest_window_after_20']:.0%} of steady | "
            f"{s['final_ce']:.4f} | {s['mean_active']:.1f} | {s['max_grad_norm_after_settle']:.2f} | "
            f"{s['seconds']:.0f} |"
        )
    gap = result["worst_ce_gap_after_settle"]
    rows.append("")
    rows.append(
        f"sparse / dense steady speed: **{result['speedup']:.3f}x**; worst CE gap after the settle: "
        f"{'n/a' if gap is None else f'{gap:+.2%}'}; commit {result['commit']}, {result['machine']}"
    )
    return "\n".join(rows) + "\n"


def plot(runs: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    for name, records in runs.items():
        steps = [r["step"] for r in records]
        axes[0, 0].plot([r["tokens"] for r in records], [r["ce"] for r in records], label=name)
        axes[0, 1].plot([r["seconds"] for r in records], [r["ce"] for r in records], label=name)
        axes[1, 0].plot(steps, [r["tokens_per_s"] for r in records], label=name)
    sparse = runs["sparse"]
    for layer in range(len(sparse[0]["active_mean"])):
        axes[1, 1].plot(
            [r["step"] for r in sparse], [r["active_mean"][layer] for r in sparse], label=f"layer {layer}"
        )
    for ax, (x, y) in zip(
        axes.flat,
        [
            ("tokens", "CE"),
            ("wall-clock seconds", "CE"),
            ("step", "tokens/s"),
            ("step", "active units / token (sparse)"),
        ],
    ):
        ax.set_xlabel(x)
        ax.set_ylabel(y)
        ax.grid(alpha=0.3)
    axes[1, 1].set_yscale("log")
    axes[0, 0].legend()
    axes[1, 1].legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def machine_name() -> str:
    import torch

    return (
        f"1 x {torch.cuda.get_device_name(0)}"
        if torch.cuda.is_available()
        else f"CPU ({os.cpu_count()} cores)"
    )


def split_extra(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the script's own arguments, the Hydra overrides after `--` for every run)."""
    if "--" not in argv:
        return argv, []
    return argv[: argv.index("--")], argv[argv.index("--") + 1 :]


def commit_of(root: Path) -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    own, overrides = split_extra(argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="outputs/race", help="folder for both runs and the race's table and plot")
    p.add_argument("--settle", type=int, default=40, help="steps before speeds and CE gaps are compared")
    p.add_argument("--only", choices=list(TWINS), help="run one twin only (the other's run folder is reused)")
    args = p.parse_args(own)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, impl in TWINS.items():
        if args.only and name != args.only:
            continue
        run_dir = out / name
        cmd = [
            sys.executable,
            str(ROOT / "train.py"),
            *overrides,
            impl,
            f"run_name=race_{name}",
            f"run_dir={run_dir}",
        ]
        print(f"[race] {name}: {' '.join(cmd[1:])}", flush=True)
        start = time.perf_counter()
        with open(out / f"{name}.log", "w") as log:
            status = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode
        print(
            f"[race] {name}: exit {status} after {time.perf_counter() - start:.0f} s (log: {out / f'{name}.log'})"
        )
        if status:
            print((out / f"{name}.log").read_text()[-3000:], file=sys.stderr)
            return status
    runs = {name: with_wall_clock(read_records(out / name)) for name in TWINS}
    result = compare(runs, args.settle)
    result.update(commit=commit_of(ROOT), machine=machine_name(), overrides=overrides, settle=args.settle)
    (out / "race.json").write_text(json.dumps({**result, "records": runs}, indent=1))
    text = table(result)
    (out / "race.md").write_text(text)
    plot(runs, out / "race.png")
    print(text)
    print(f"[race] wrote {out / 'race.json'}, {out / 'race.md'}, {out / 'race.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
