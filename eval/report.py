"""Turn lm-eval's results dict into a table, flat metrics for loggers, and a JSON file."""

from __future__ import annotations

import json
from pathlib import Path

TABLE_METRICS = ("acc", "acc_norm")


def summarize(results: dict) -> dict[str, dict[str, float]]:
    """{task: {metric: value}} for the top-level tasks and groups, e.g. {'piqa': {'acc': 0.6, ...}}."""
    per_task = results["results"]
    subtasks = {child for children in results.get("group_subtasks", {}).values() for child in children}
    summary = {}
    for task, metrics in per_task.items():
        if task in subtasks:
            continue  # shown through its group (e.g. the 57 MMLU subjects under "mmlu")
        values = {}
        for key, value in metrics.items():
            metric, _, _filter = key.partition(",")
            if _filter and not metric.endswith("_stderr") and isinstance(value, (int, float)):
                values[metric] = float(value)
        summary[task] = values
    return summary


def mean_accuracy(summary: dict[str, dict[str, float]], tasks: list[str]) -> dict[str, float]:
    """Mean acc and acc_norm over `tasks` (acc_norm falls back to acc where a task has none)."""
    present = [t for t in tasks if t in summary and "acc" in summary[t]]
    if not present:
        return {}
    acc = sum(summary[t]["acc"] for t in present) / len(present)
    norm = sum(summary[t].get("acc_norm", summary[t]["acc"]) for t in present) / len(present)
    return {"acc": acc, "acc_norm": norm, "tasks": len(present)}


def results_table(results: dict, mean_over: list[str] | None = None) -> str:
    """Markdown table: task, samples, acc, acc_norm (and a mean row over `mean_over`)."""
    summary = summarize(results)
    samples = results.get("n-samples", {})
    lines = ["| task | samples | acc | acc_norm |", "|---|---:|---:|---:|"]

    def cell(value):
        return "-" if value is None else f"{100 * value:.1f}"

    groups = results.get("group_subtasks", {})

    def n_samples(task):  # a group's samples are its subtasks'
        if task in samples:
            return samples[task].get("effective", "")
        return sum(n_samples(child) or 0 for child in groups.get(task, [])) or ""

    for task, values in summary.items():
        n = n_samples(task)
        lines.append(f"| {task} | {n} | {cell(values.get('acc'))} | {cell(values.get('acc_norm'))} |")
    if mean_over:
        mean = mean_accuracy(summary, mean_over)
        if mean:
            lines.append(
                f"| mean ({mean['tasks']} tasks) | | {cell(mean['acc'])} | {cell(mean['acc_norm'])} |"
            )
    return "\n".join(lines)


def flat_metrics(results: dict, prefix: str = "eval/") -> dict[str, float]:
    """{'eval/piqa/acc': 0.61, ...}: for the JSONL and wandb loggers."""
    return {
        f"{prefix}{task}/{metric}": value
        for task, values in summarize(results).items()
        for metric, value in values.items()
    }


def save_results(results: dict, path: str | Path) -> Path:
    """lm-eval's results as JSON (non-serialisable values as strings, like lm-eval's own CLI)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2, default=str))
    return path
