"""Per-layer activity plots of a training run, from its metrics.jsonl.

    python scripts/plot_activity.py outputs/quickstart            # writes outputs/quickstart/activity.png
    python scripts/plot_activity.py outputs/run/metrics.jsonl --out activity.png

Panels, one line per layer: mean active hidden units per token, dead fraction (units that did not fire
within the dead window), and fraction of units that fired at least once in each log window; plus
CE and L1 over training.
"""

import argparse
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: works on machines without a display
import matplotlib.pyplot as plt

PANELS = (
    ("active_mean", "active units / token (mean)", True),
    ("dead_frac", "dead fraction", False),
    ("fired_frac", "fired at least once in window", False),
)


def read_records(path: Path) -> list[dict]:
    """Training records (those with per-layer activity), the last one written for each step."""
    by_step = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        try:
            record = json.loads(line)
        except ValueError:
            print(f"warning: {path}:{number} is not JSON, skipped", file=sys.stderr)
            continue
        if "active_mean" in record:
            by_step[record["step"]] = record
    return [by_step[step] for step in sorted(by_step)]


def plot(records: list[dict], out: Path, title: str) -> None:
    steps = [r["step"] for r in records]
    n_layers = len(records[0]["active_mean"])
    fig, axes = plt.subplots(2, 2, figsize=(12, 8), constrained_layout=True)
    cmap = plt.get_cmap("viridis")
    for ax, (key, label, log_scale) in zip(axes.flat, PANELS):
        for layer in range(n_layers):
            values = [r[key][layer] for r in records]
            ax.plot(steps, values, color=cmap(layer / max(n_layers - 1, 1)), lw=1, label=f"layer {layer}")
        ax.set(xlabel="step", ylabel=label, title=label)
        if log_scale and all(r[key][i] > 0 for r in records for i in range(n_layers)):
            ax.set_yscale("log")
    axes[0, 0].legend(fontsize=7, ncol=max(1, n_layers // 10))
    ax = axes[1, 1]
    ax.plot(steps, [r["ce"] for r in records], label="CE")
    ax.set(xlabel="step", ylabel="CE", title="cross-entropy and L1")
    twin = ax.twinx()
    twin.plot(steps, [r["l1"] for r in records], color="tab:red", label="L1")
    twin.set_ylabel("L1 (sum |h| per token)", color="tab:red")
    fig.suptitle(title)
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="a run dir (with metrics.jsonl) or a metrics.jsonl file")
    parser.add_argument("--out", type=Path, help="PNG to write (default: <run dir>/activity.png)")
    args = parser.parse_args()
    path = args.run / "metrics.jsonl" if args.run.is_dir() else args.run
    if not path.is_file():
        sys.exit(f"error: {path} does not exist; pass a run dir of train.py or its metrics.jsonl")
    records = read_records(path)
    if not records:
        sys.exit(f"error: {path} has no training records with activity statistics (is it a train.py log?)")
    out = args.out or path.parent / "activity.png"
    plot(
        records,
        out,
        f"{path.parent.name}: {len(records)} records, steps {records[0]['step']}..{records[-1]['step']}",
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
