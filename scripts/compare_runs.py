"""Compare training runs side by side from their metrics.jsonl: final CE and validation loss, activity
(mean active hidden units per token, per layer and overall), dead fraction and re-initialised units.

    python scripts/compare_runs.py outputs/fid_dense outputs/fid_sparse [--out table.json]

CE is the mean of the last `--tail` logged training records (smooths the per-step noise); the CE gap
is relative to the first run given. Activity is the last logged window's, and its share of d_ff.
"""

import argparse
import json
import sys
from pathlib import Path


def load(run: Path) -> tuple[list[dict], list[dict]]:
    path = run / "metrics.jsonl" if run.is_dir() else run
    if not path.is_file():
        sys.exit(f"error: {path} not found; pass a run dir holding metrics.jsonl or the file itself")
    train, val = [], []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if "ce" in record:
            train.append(record)
        elif "val_loss" in record:
            val.append(record)
    if not train:
        sys.exit(f"error: {path} has no training records (keys 'step' and 'ce')")
    return train, val


def summarize(run: Path, tail: int, d_ff: int | None) -> dict:
    train, val = load(run)
    last = train[-1]
    window = train[-tail:]
    active = last.get("active_mean") or []
    width = d_ff or (round(active[0] / last["active_frac"][0]) if active and last["active_frac"][0] else None)
    mean_active = sum(active) / len(active) if active else float("nan")
    reinit_total = sum(sum(r.get("reinit_units") or []) for r in train)
    dead = last.get("dead_frac") or []
    return {
        "run": str(run),
        "steps": last["step"],
        "tokens": last.get("tokens"),
        "ce": sum(r["ce"] for r in window) / len(window),
        "val_loss": val[-1]["val_loss"] if val else None,
        "l1_coef": last.get("l1_coef"),
        "active_mean": mean_active,
        "active_pct_of_d_ff": 100 * mean_active / width if width else None,
        "active_per_layer": [round(a, 1) for a in active],
        "active_max": max(last.get("active_max") or [0]),
        "dead_frac_mean": sum(dead) / len(dead) if dead else None,
        "dead_frac_per_layer": [round(d, 4) for d in dead],
        "reinit_units_total": reinit_total,
        "overflow_rows": sum(last.get("overflow_rows") or []),
        "tokens_per_s": last.get("tokens_per_s"),
        "d_ff": width,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "runs", nargs="+", type=Path, help="run dirs (or metrics.jsonl files); the first is the baseline"
    )
    p.add_argument("--tail", type=int, default=5, help="training records averaged for CE (default 5)")
    p.add_argument("--d-ff", type=int, help="hidden width (default: inferred from active_mean / active_frac)")
    p.add_argument("--out", type=Path, help="also write the rows as JSON")
    args = p.parse_args()
    if args.tail < 1:
        sys.exit(f"error: --tail must be >= 1, got {args.tail}")
    rows = [summarize(run, args.tail, args.d_ff) for run in args.runs]
    base = rows[0]["ce"]
    header = "| run | steps | tokens | l1 | CE | CE vs first | val | active/token | % d_ff | dead | re-init |"
    print(header)
    print("|" + "|".join("---" for _ in range(11)) + "|")
    for row in rows:
        row["ce_rel_to_first"] = row["ce"] / base - 1
        val = f"{row['val_loss']:.3f}" if row["val_loss"] is not None else "-"
        pct = f"{row['active_pct_of_d_ff']:.2f}%" if row["active_pct_of_d_ff"] is not None else "-"
        dead = f"{row['dead_frac_mean']:.3f}" if row["dead_frac_mean"] is not None else "-"
        print(
            f"| {Path(row['run']).name} | {row['steps']} | {row['tokens']} | {row['l1_coef']} | {row['ce']:.3f} | "
            f"{100 * row['ce_rel_to_first']:+.2f}% | {val} | {row['active_mean']:.1f} | {pct} | {dead} | "
            f"{row['reinit_units_total']} |"
        )
    for row in rows:
        print(f"{Path(row['run']).name}: active per layer {row['active_per_layer']}")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
