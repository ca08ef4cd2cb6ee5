"""The race: the sparse model and its dense twin trained by the real trainer (train.py) on the same
tokens with the same L1 coefficient, one after the other on this machine (or side by side on its GPUs:
`--gpus`), then compared.

    python scripts/race.py --out outputs/race -- experiment=paper_0.5b data=local train.steps=200 \\
        train.global_batch_tokens=16384 sparsity.l1_coef=1e-3 eval.interval=0 checkpoint.interval=0

Everything after `--` is Hydra overrides for both runs; the sparse run adds model.ffn_impl=auto (the
paper recipe's default) and the dense twin model.ffn_impl=dense. `--variant NAME "OVERRIDES"` (repeatable)
adds a sparse run with more overrides, compared with the dense twin as the sparse one is, e.g. the
training-health questions of the dead-unit re-initialisation:

    python scripts/race.py --out outputs/health --variant no_reinit "sparsity=paper_no_reinit" \\
        --variant reinit_every_step "sparsity.dead_window_tokens=0" -- experiment=paper_0.5b ... train.steps=800

Writes <out>/race.json, <out>/race.md (the table) and <out>/race.png: CE against tokens and against
wall-clock seconds, tokens/s over steps, active units per token per layer over the sparse run's steps,
the gradient norm over steps and the units re-initialised per logging window, for every run.

Speeds are per logging window (metrics.jsonl). "steady" is the median window after --settle steps (the
compile, the warm-up and the switch to the sparse path happen before it); "slowest" is the slowest window
after step 20 against that median, the cost of the switch a user sees, and, for the sparse runs, against
the dense twin's median too (a window in which layers switch runs partly dense: the slower path's speed is
its reference). The CE gap is the sparse run's CE
against the dense twin's at the same step, worst over the logged steps after --settle.

A single pair does not say whether a CE gap is the sparse path's: the GPU runs are not bit-reproducible
(dense twins of one recipe already differ at step 10), and early in training a difference in the last bit
grows within steps. Two runs of the same dense recipe on one H200 or H100 have differed by 0.5-3.5% in CE
at steps 50-100 (docs/RESULTS.md, "How far apart two runs of one recipe are"). `--repeats N` runs every
twin and variant N times (the repeats named sparse_2, dense_2, ...) and compares the twins' mean CE per
step, beside the noise floor: how far the dense twin's repeats are from its first run. `--gpus N` runs
N of them at once, one GPU each (the first N visible devices), in the same order; speeds are then those
of runs sharing the node's host CPUs, so compare runs of one race with each other.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
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
        "slowest_window_tokens_per_s": min(late),
        "slowest_window_after_20": min(late) / steady,
        "final_ce": records[-1]["ce"],
        "seconds": records[-1]["seconds"],
        "tokens": records[-1]["tokens"],
        "mean_active": sum(records[-1]["active_mean"]) / len(records[-1]["active_mean"]),
        "max_grad_norm_after_settle": max(
            (r["grad_norm"] for r in records if r["step"] > settle), default=records[-1]["grad_norm"]
        ),
        "reinit_units": sum(sum(r.get("reinit_units") or [0]) for r in records),  # logged per window
    }


def ce_gaps(run: list[dict], dense: list[dict], settle: int) -> tuple[float | None, float | None]:
    """(worst relative CE gap against the dense twin at the same step after the settle, final gap)."""
    dense_ce = {r["step"]: r["ce"] for r in dense}
    gaps = [(r["ce"] - dense_ce[r["step"]]) / dense_ce[r["step"]] for r in run if r["step"] in dense_ce]
    late_gaps = [g for r, g in zip(run, gaps) if r["step"] > settle] or gaps
    return (max(late_gaps, key=abs) if late_gaps else None), (gaps[-1] if gaps else None)


def repeat_name(name: str, repeat: int) -> str:
    """The run name of a twin's (or variant's) repeat: `name` for the first, `name_<repeat>` after it."""
    return name if repeat == 1 else f"{name}_{repeat}"


def mean_ce(runs: list[list[dict]]) -> dict[int, float]:
    """Mean CE per step over the runs that logged that step in every run."""
    steps = set.intersection(*({r["step"] for r in records} for records in runs))
    by_step = [{r["step"]: r["ce"] for r in records} for records in runs]
    return {s: statistics.fmean(ce[s] for ce in by_step) for s in sorted(steps)}


def present(groups: dict[str, list[str]] | None, runs: dict) -> dict[str, list[str]]:
    """Each twin's (or variant's) runs among `runs` (a repeat not run yet, or cut short, is absent)."""
    return {base: [n for n in names if n in runs] for base, names in (groups or {}).items()}


def group_compare(
    runs: dict[str, list[dict]], groups: dict[str, list[str]], summary: dict, settle: int
) -> dict:
    """Over each twin's (and variant's) repeats (`groups`: only runs present; `summary`: compare's per-run
    summaries): the median of their steady speeds, the mean CE per step and its gap against the dense twin's
    mean after the settle, the spread of the last CE over the repeats. The noise floor: the worst CE gap after
    the settle of a dense repeat against the first dense run (None with one run)."""
    out = {}
    dense_ce = mean_ce([runs[n] for n in groups["dense"]])
    dense_speed = statistics.median(summary[n]["steady_tokens_per_s"] for n in groups["dense"])
    for base, names in groups.items():
        if not names:
            continue
        ce = mean_ce([runs[n] for n in names])
        late = [(ce[s] - dense_ce[s]) / dense_ce[s] for s in ce if s in dense_ce and s > settle]
        finals = [runs[n][-1]["ce"] for n in names]
        speed = statistics.median(summary[n]["steady_tokens_per_s"] for n in names)
        out[base] = {
            "runs": names,
            "steady_tokens_per_s": speed,
            "speedup": speed / dense_speed,
            "mean_final_ce": statistics.fmean(finals),
            "final_ce_spread": (max(finals) - min(finals)) / statistics.fmean(finals),
            "worst_mean_ce_gap_after_settle": max(late, key=abs) if late and base != "dense" else None,
        }
    # A dense repeat is compared with the first dense run like any other run (compare, above).
    floor = [g for n in groups["dense"][1:] if (g := summary[n]["worst_ce_gap_after_settle"]) is not None]
    out["noise_floor"] = max(floor, key=abs) if floor else None
    return out


def compare(runs: dict[str, list[dict]], settle: int, groups: dict[str, list[str]] | None = None) -> dict:
    """Every run summarised; each sparse run (the sparse twin and any --variant) and each repeat against
    the dense twin's first run: speed ratio and CE gaps in its summary, the sparse twin's also at the top
    level. With repeats (`groups`: twin or variant -> its runs' names), their means too (group_compare)."""
    summary = {name: summarize(records, settle) for name, records in runs.items()}
    for name, records in runs.items():
        if name != "dense":
            worst, final = ce_gaps(records, runs["dense"], settle)
            dense_steady = summary["dense"]["steady_tokens_per_s"]
            speedup = summary[name]["steady_tokens_per_s"] / dense_steady
            # Issue 30's switch target: the windows in which layers switch (part dense, part sparse) against
            # the steady speed of the slower path, the dense twin's.
            slowest_vs_dense = summary[name]["slowest_window_tokens_per_s"] / dense_steady
            summary[name].update(
                speedup=speedup, worst_ce_gap_after_settle=worst, final_ce_gap=final,
                slowest_window_vs_dense=slowest_vs_dense,
            )  # fmt: skip
    sparse = summary["sparse"]
    result = {
        **summary,
        "runs": list(runs),
        "speedup": sparse["speedup"],
        "worst_ce_gap_after_settle": sparse["worst_ce_gap_after_settle"],
        "final_ce_gap": sparse["final_ce_gap"],
    }
    groups = present(groups, runs)
    if any(len(names) > 1 for names in groups.values()):
        result["repeats"] = group_compare(runs, groups, summary, settle)
    return result


def _percent(value: float | None) -> str:
    return "" if value is None else f"{value:+.2%}"


def table(result: dict) -> str:
    rows = [
        "| run | steady tokens/s | vs dense | slowest window after step 20 (of its steady; of the dense twin's) "
        "| final CE | worst CE gap after the settle | mean active units | max grad norm | units re-initialised "
        "| seconds |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in result["runs"]:
        s = result[name]
        speed = f"{s['speedup']:.3f}x" if "speedup" in s else ""
        slowest = f"{s['slowest_window_after_20']:.0%}"
        if "slowest_window_vs_dense" in s:
            slowest += f"; {s['slowest_window_vs_dense']:.0%}"
        rows.append(
            f"| {name} | {s['steady_tokens_per_s']:,.0f} | {speed} | {slowest} | "
            f"{s['final_ce']:.4f} | {_percent(s.get('worst_ce_gap_after_settle'))} | {s['mean_active']:.1f} | "
            f"{s['max_grad_norm_after_settle']:.2f} | {s['reinit_units']:,} | {s['seconds']:.0f} |"
        )
    gap = result["worst_ce_gap_after_settle"]
    rows.append("")
    rows.append(
        f"sparse / dense steady speed: **{result['speedup']:.3f}x**; worst CE gap after the settle: "
        f"{'n/a' if gap is None else f'{gap:+.2%}'}; commit {result['commit']}, {result['machine']}"
        + (f", {result['gpus']} runs side by side (one device each)" if result.get("gpus", 1) > 1 else "")
    )
    if "repeats" in result:
        rows += repeats_table(result["repeats"])
    return "\n".join(rows) + "\n"


def repeats_table(repeats: dict) -> list[str]:
    rows = [
        "",
        "| twin, over its repeats | runs | median steady tokens/s | vs dense | mean final CE (spread) "
        "| worst gap of the mean CE after the settle |",
        "|---|---|---|---|---|---|",
    ]
    for base, g in repeats.items():
        if base == "noise_floor":
            continue
        rows.append(
            f"| {base} | {len(g['runs'])} | {g['steady_tokens_per_s']:,.0f} | {g['speedup']:.3f}x | "
            f"{g['mean_final_ce']:.4f} ({g['final_ce_spread']:.2%}) | "
            f"{_percent(g['worst_mean_ce_gap_after_settle'])} |"
        )
    floor = repeats["noise_floor"]
    rows += [
        "",
        "noise floor (the dense twin's repeats against its first run, worst CE gap after the settle): "
        + ("n/a (one dense run)" if floor is None else f"{floor:+.2%}"),
    ]
    return rows


def plot(runs: dict[str, list[dict]], path: Path, groups: dict[str, list[str]] | None = None) -> None:
    """The race's PNG. With repeats (`groups`), CE against tokens is each twin's mean over its runs with
    the band from its lowest to its highest run; every other panel shows every run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(18, 8))
    banded = {base: names for base, names in present(groups, runs).items() if len(names) > 1}
    for base, names in banded.items():
        mean = mean_ce([runs[n] for n in names])
        by_step = [{r["step"]: r for r in runs[n]} for n in names]
        steps = list(mean)
        tokens = [by_step[0][s]["tokens"] for s in steps]
        line = axes[0, 0].plot(tokens, list(mean.values()), label=f"{base} (mean of {len(names)})")[0]
        low = [min(b[s]["ce"] for b in by_step) for s in steps]
        high = [max(b[s]["ce"] for b in by_step) for s in steps]
        axes[0, 0].fill_between(tokens, low, high, color=line.get_color(), alpha=0.2)
    in_bands = {n for names in banded.values() for n in names}
    for name, records in runs.items():
        steps = [r["step"] for r in records]
        if name not in in_bands:
            axes[0, 0].plot([r["tokens"] for r in records], [r["ce"] for r in records], label=name)
        axes[0, 1].plot([r["seconds"] for r in records], [r["ce"] for r in records], label=name)
        axes[1, 0].plot(steps, [r["tokens_per_s"] for r in records], label=name)
        axes[0, 2].plot(steps, [r["grad_norm"] for r in records], label=name)
        axes[1, 2].plot(steps, [sum(r.get("reinit_units") or [0]) for r in records], label=name)
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
            ("step", "gradient norm"),
            ("step", "tokens/s"),
            ("step", "active units / token (sparse)"),
            ("step", "units re-initialised per logging window"),
        ],
    ):
        ax.set_xlabel(x)
        ax.set_ylabel(y)
        ax.grid(alpha=0.3)
    axes[1, 1].set_yscale("log")
    axes[0, 2].set_yscale("log")
    axes[0, 0].legend()
    axes[1, 0].legend(fontsize=7)  # every run's colour, in every panel but the first
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
    """The checkout's commit, "-dirty" when its tracked files differ from it (a run of uncommitted code)."""
    out = subprocess.run(
        ["git", "describe", "--always", "--dirty", "--abbrev=7"], cwd=root, capture_output=True, text=True
    )
    return out.stdout.strip() or "unknown"


def devices_for(gpus: int) -> list[str | None]:
    """The device each of `gpus` concurrent runs gets (CUDA_VISIBLE_DEVICES of its process): the first
    `gpus` of this process's visible devices; [None] (inherit) for one run at a time."""
    if gpus == 1:
        return [None]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [d.strip() for d in visible.split(",") if d.strip()] if visible else [str(i) for i in range(gpus)]
    if len(ids) < gpus:
        raise SystemExit(f"--gpus {gpus}: CUDA_VISIBLE_DEVICES={visible!r} names only {len(ids)} devices")
    return ids[:gpus]


def run_all(jobs: dict[str, list[str]], out: Path, devices: list[str | None]) -> tuple[int, dict]:
    """Run the jobs (name -> command) in order, as many at once as there are devices, each alone on its
    device; each job's output goes to <out>/<name>.log. Returns (the first non-zero exit status or 0, per
    job: its device and start / end seconds after the first start). A failed job lets the running ones
    finish and starts no other."""
    pending, running, schedule, status = list(jobs.items()), {}, {}, 0
    free, t0 = list(devices), time.perf_counter()
    while running or (pending and not status):
        while pending and free and not status:
            name, cmd = pending.pop(0)
            device = free.pop(0)
            env = dict(os.environ)
            if device is not None:
                env["CUDA_VISIBLE_DEVICES"] = device
            where = "" if device is None else f" on device {device}"
            print(f"[race] {name}{where}: {' '.join(cmd[1:])}", flush=True)
            log = open(out / f"{name}.log", "w")
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
            running[name] = (proc, log, device)
            schedule[name] = {"device": device, "start_s": time.perf_counter() - t0}
        for name, (proc, log, device) in list(running.items()):
            code = proc.poll()
            if code is None:
                continue
            log.close()
            del running[name]
            free.append(device)
            schedule[name]["end_s"] = end = time.perf_counter() - t0
            print(
                f"[race] {name}: exit {code} after {end - schedule[name]['start_s']:.0f} s (log: {out / f'{name}.log'})"
            )
            if code and not status:
                print((out / f"{name}.log").read_text()[-3000:], file=sys.stderr)
                status = code
        if running:
            time.sleep(0.2)
    return status, schedule


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    own, overrides = split_extra(argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="outputs/race", help="folder for both runs and the race's table and plot")
    p.add_argument("--settle", type=int, default=40, help="steps before speeds and CE gaps are compared")
    p.add_argument(
        "--variant", nargs=2, action="append", default=[], metavar=("NAME", "OVERRIDES"),
        help="another sparse run: a name and its extra Hydra overrides in one string (repeatable)",
    )  # fmt: skip
    p.add_argument(
        "--only", nargs="+", default=None,
        help="run these only (sparse, dense or variants); the others' folders are reused, a variant not run yet is left out",
    )  # fmt: skip
    p.add_argument(
        "--repeats", type=int, default=1,
        help="runs of every twin and variant (the noise floor of the CE gap: see above); default 1",
    )  # fmt: skip
    p.add_argument(
        "--gpus", type=int, default=1,
        help="runs side by side, one GPU each (the first N visible devices); default 1: one after the other",
    )  # fmt: skip
    p.add_argument(
        "--no-run", action="store_true",
        help="run nothing: the table and plot from the runs already in --out (e.g. after a time limit cut the race)",
    )  # fmt: skip
    args = p.parse_args(own)
    if args.repeats < 1:
        p.error(f"--repeats {args.repeats} must be at least 1")
    if args.gpus < 1:
        p.error(f"--gpus {args.gpus} must be at least 1")
    bases = {name: [impl] for name, impl in TWINS.items()}
    for name, extra in args.variant:
        taken = {repeat_name(b, r) for b in bases for r in range(1, args.repeats + 1)}
        if not name.isidentifier() or name in taken:
            p.error(
                f"--variant name {name!r} must be a new identifier (not sparse, dense or a repeat's name)"
            )
        bases[name] = [TWINS["sparse"], *shlex.split(extra)]
    # Every twin and variant once, then again for each repeat: machine drift spreads over all of them.
    groups = {base: [repeat_name(base, r) for r in range(1, args.repeats + 1)] for base in bases}
    runs = {repeat_name(base, r): bases[base] for r in range(1, args.repeats + 1) for base in bases}
    for name in args.only or ():
        if name not in runs:
            p.error(f"--only {name!r} is none of the runs: {', '.join(runs)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    jobs = {
        name: [sys.executable, str(ROOT / "train.py"), *overrides, *own, f"run_name=race_{name}", f"run_dir={out / name}"]
        for name, own in runs.items()
        if not args.no_run and not (args.only and name not in args.only)
    }  # fmt: skip
    status, schedule = run_all(jobs, out, devices_for(args.gpus))
    if status:
        return status
    missing = [name for name in runs if name not in TWINS and not (out / name / "metrics.jsonl").is_file()]
    if missing:
        print(f"[race] not run yet, left out of the table: {', '.join(missing)}")
    records = {name: with_wall_clock(read_records(out / name)) for name in runs if name not in missing}
    # A run cut short (a time limit, then --no-run) would shorten the steps its repeats are averaged over.
    last = records["dense"][-1]["step"]
    short = [name for name in records if name not in TWINS and records[name][-1]["step"] < last]
    if short:
        print(f"[race] stopped before step {last}, left out of the table: {', '.join(short)}")
        records = {name: r for name, r in records.items() if name not in short}
    result = compare(records, args.settle, groups)
    # --no-run tables runs made elsewhere: this machine is not theirs.
    machine = machine_name() if jobs else "machine not recorded (tabled by --no-run)"
    result.update(commit=commit_of(ROOT), machine=machine, overrides=overrides, settle=args.settle)
    result["variants"] = {name: extra for name, extra in args.variant}
    result["repeat_count"] = args.repeats
    result["gpus"], result["schedule"] = args.gpus, schedule
    (out / "race.json").write_text(json.dumps({**result, "records": records}, indent=1))
    text = table(result)
    (out / "race.md").write_text(text)
    plot(records, out / "race.png", groups)
    print(text)
    print(f"[race] wrote {out / 'race.json'}, {out / 'race.md'}, {out / 'race.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
