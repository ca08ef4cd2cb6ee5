"""Where relative data paths point.

Hydra does not change the working directory in our setup, so a relative path means "relative to
where you ran the command". The offline defaults (``offline/sample``, ``offline/tokenizer``) live in
the project root, so a relative path that matches nothing under the working directory is tried
against the project root as well: ``python ../twell/train.py`` still finds them.
"""

from __future__ import annotations

import glob
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[1]


def resolve_path(path: str) -> Path:
    """A file or folder: absolute as given, else under the cwd if it exists there, else under the project root."""
    candidate = Path(path).expanduser()
    if candidate.is_absolute() or candidate.exists():
        return candidate
    under_root = PROJECT_ROOT / candidate
    return under_root if under_root.exists() else candidate


def expand_files(spec: str, what: str) -> list[str]:
    """Comma-separated files, folders or globs -> sorted list of files; a clear error when one matches nothing."""
    files: list[str] = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        if is_url(part):  # http(s)://, hf://, s3://: read through fsspec, taken as given (no globbing)
            files.append(part)
            continue
        matches = _matches(part) or _matches(str(PROJECT_ROOT / part))
        if not matches:
            raise FileNotFoundError(
                f"{what}: no files match {part!r} (looked under {_under()}). "
                "Fix the path, or create the offline sample with `python scripts/prepare_offline_data.py`."
            )
        files.extend(matches)
    if not files:
        raise ValueError(f"{what} is empty ({spec!r}): give a file, a folder or a glob")
    return files


def is_url(path: str) -> bool:
    return "://" in path


def _under() -> str:
    """Where relative paths are looked up: the working folder, and the project root when it differs."""
    here = Path.cwd()
    return str(here) if here.resolve() == PROJECT_ROOT.resolve() else f"{here} and {PROJECT_ROOT}"


def _matches(pattern: str) -> list[str]:
    path = Path(pattern).expanduser()
    if path.is_dir():
        return sorted(str(p) for p in path.iterdir() if p.is_file() and not p.name.startswith("."))
    return sorted(p for p in glob.glob(str(path), recursive=True) if Path(p).is_file())
