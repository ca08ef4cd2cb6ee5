"""Plot whole-model benchmark results (scripts/bench_model.py JSON files) side by side, one group per model.

    python scripts/plot_bench_model.py docs/results/round14/bench_model_{0.5b,1b,1.5b,2b}.json \\
        --out docs/results/model/bench_model_h200.png

Three panels: inference tokens/ms, training tokens/ms and inference energy per token, each with a bar
per variant (dense / TwELL, eager and compiled where measured) and TwELL's gain over the same kind of
dense run written above its bar.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

PANELS = (
    ("infer", "tokens_per_ms", "inference tokens / ms (higher is better)"),
    ("train", "tokens_per_ms", "training tokens / ms (higher is better)"),
    ("infer", "mj_per_token", "inference energy, mJ / token (lower is better)"),
)
VARIANTS = ("dense", "twell", "dense+compile", "twell+compile")
COLORS = {"dense": "#9e9e9e", "twell": "#64b5f6", "dense+compile": "#424242", "twell+compile": "#1565c0"}


def load(paths: list[str]) -> list[tuple[str, dict]]:
    """(label, {(mode, variant): row}) per file; the label is the model's name as the bench wrote it."""
    runs = []
    for path in paths:
        doc = json.loads(Path(path).read_text())
        if "rows" not in doc:
            raise SystemExit(f"error: {path} has no 'rows': not a bench_model.py result")
        label = str(doc.get("model", Path(path).stem)).replace(" (random, calibrated)", "")
        runs.append((label, {(r["mode"], r["variant"]): r for r in doc["rows"]}))
    return runs


def plot(runs: list[tuple[str, dict]], out: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PANELS), figsize=(5.2 * len(PANELS), 4.2))
    width = 0.8 / len(VARIANTS)
    for ax, (mode, key, title) in zip(axes, PANELS):
        for v, variant in enumerate(VARIANTS):
            for i, (_label, rows) in enumerate(runs):
                row = rows.get((mode, variant))
                if row is None or row.get(key) is None:
                    continue
                x = i + (v - (len(VARIANTS) - 1) / 2) * width
                ax.bar(x, row[key], width, color=COLORS[variant], label=variant if i == 0 else None)
                base = rows.get((mode, variant.replace("twell", "dense")))
                if variant.startswith("twell") and base is not None and base.get(key):
                    change = (row[key] / base[key] - 1) * 100
                    ax.text(x, row[key], f"{change:+.0f}%", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(runs)), [label for label, _ in runs])
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(VARIANTS), frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    path = Path(out)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None) -> Path:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", help="bench_model.py JSON files, one per model")
    p.add_argument("--out", default="bench_model.png")
    args = p.parse_args(argv)
    path = plot(load(args.results), args.out)
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
