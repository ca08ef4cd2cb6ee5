"""How far apart two runs of one race recipe are (issue 30's CE target), from races already run on GPUs:

    python docs/results/2026-12-05-f/noise_floor.py > docs/results/2026-12-05-f/noise_floor.txt

Reads every race archive of sessions (d) (one H200) and (e) (one H100) of 2026-12-05: each holds the
metrics.jsonl of a dense twin and of sparse runs, all `experiment=paper_<size>` with the same overrides
(16k-token steps of 8 x 2048 from the offline sample, L1 1e-3, warm-up 20, 100 steps, CE logged as the mean
of each 10-step window). The dense twin's code path did not change between these trees, so dense against
dense is the recipe's run-to-run spread (GPU non-determinism amplified by training), the floor under any
sparse-against-dense CE gap. Gaps are relative, at the same step, over the windows after step 50 (the
races' settle).
"""

import itertools
import json
import statistics
import sys
import tarfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2] / "scripts"))
from race import ce_gaps  # noqa: E402  (the race's own gap: worst after the settle, and at the last step)

ARCHIVES = sorted(HERE.parent.glob("2026-12-05-[de]/call*/*.tgz"))
SETTLE = 50


def runs_of(archive: Path) -> dict[str, dict[int, float]]:
    """run name -> {step: CE} for every metrics.jsonl in the archive."""
    out = {}
    with tarfile.open(archive) as tar:
        for member in tar.getmembers():
            if member.name.endswith("/metrics.jsonl"):
                lines = tar.extractfile(member).read().decode().splitlines()
                records = [json.loads(line) for line in lines if line.strip()]
                out[member.name.split("/")[-2]] = {r["step"]: r["ce"] for r in records if "ce" in r}
    return out


def size_of(archive: Path, dense: dict[int, float]) -> str:
    # The 0.5b and 1.5b presets start from different CEs at step 10 (~9.48 and ~10.57).
    return "0.5b" if dense[10] < 10 else "1.5b"


def gaps(a: dict[int, float], b: dict[int, float]) -> tuple[float, float]:
    """(worst gap of run a's CE against run b's after the settle, gap at the last step), as race.py has it."""
    return ce_gaps(
        *([{"step": step, "ce": ce} for step, ce in sorted(run.items())] for run in (a, b)), SETTLE
    )


def main() -> None:
    races = []
    for archive in ARCHIVES:
        runs = runs_of(archive)
        label = f"{archive.parent.parent.name[-1]}/{archive.parent.name}"
        races.append((label, size_of(archive, runs["dense"]), runs))
    for size in ("0.5b", "1.5b"):
        mine = [(label, runs) for label, s, runs in races if s == size]
        print(f"## {size}: {len(mine)} races")
        print(
            "\n| dense twin against dense twin | worst gap after step 50 | gap at step 100 |\n|---|---|---|"
        )
        floor = []
        for (la, ra), (lb, rb) in itertools.combinations(mine, 2):
            worst, last = gaps(ra["dense"], rb["dense"])
            floor.append(worst)
            print(f"| {la} vs {lb} | {worst:+.2%} | {last:+.2%} |")
        print(
            "\n| sparse run against its race's dense twin | worst gap after step 50 | gap at step 100 |\n|---|---|---|"
        )
        sparse = []
        for label, runs in mine:
            for name, ce in runs.items():
                if name != "dense":
                    worst, last = gaps(ce, runs["dense"])
                    sparse.append((worst, last))
                    print(f"| {label} {name} | {worst:+.2%} | {last:+.2%} |")
        finals = {kind: [runs[n][100] for _, runs in mine for n in runs if (n == "dense") == (kind == "dense")]
                  for kind in ("dense", "sparse")}  # fmt: skip
        print(
            f"\nworst |gap|, dense vs dense: {min(map(abs, floor)):.2%} to {max(map(abs, floor)):.2%}; "
            f"sparse vs dense: {min(abs(w) for w, _ in sparse):.2%} to {max(abs(w) for w, _ in sparse):.2%}"
        )
        for kind, values in finals.items():
            print(
                f"CE at step 100, {kind} runs ({len(values)}): mean {statistics.fmean(values):.4f}, "
                f"sd {statistics.stdev(values):.4f} ({statistics.stdev(values) / statistics.fmean(values):.2%})"
            )
        dense_mean, sparse_mean = statistics.fmean(finals["dense"]), statistics.fmean(finals["sparse"])
        print(f"mean sparse / mean dense at step 100: {sparse_mean / dense_mean - 1:+.2%}\n")
        # Step by step: until the layers switch (the sparse runs' mean activity falls below the threshold, 50
        # units a token, checked every few steps) a sparse run computes exactly what its dense twin does, so
        # the gap there is the spread of one code path.
        print(
            "| step | dense runs: mean CE (sd) | sparse runs: mean CE (sd) | gap of the means |\n|---|---|---|---|"
        )
        for step in sorted(mine[0][1]["dense"]):
            d = [runs[n][step] for _, runs in mine for n in runs if n == "dense"]
            sp = [runs[n][step] for _, runs in mine for n in runs if n != "dense"]
            print(
                f"| {step} | {statistics.fmean(d):.4f} ({statistics.stdev(d):.4f}) | "
                f"{statistics.fmean(sp):.4f} ({statistics.stdev(sp):.4f}) | "
                f"{statistics.fmean(sp) / statistics.fmean(d) - 1:+.2%} |"
            )
        print()


if __name__ == "__main__":
    main()
