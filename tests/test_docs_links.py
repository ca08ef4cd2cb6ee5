"""Every file the user-facing docs point at exists: relative Markdown links in README.md and docs/*.md,
and repository paths they name in backticks (`kernels/training/train.py`, `docs/results/...`).

docs/results/ keeps only the raw files the docs cite (history lives in git), so deleting or moving a
file that a table still cites fails here, and so does a doc that cites a file that was never kept."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Top-level folders of the repository: a backticked path starting with one of them is a path.
TOP = tuple(p.name + "/" for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith("."))
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")
CODE = re.compile(r"`([^`\s]+)`")


def _targets(doc: Path):
    text = doc.read_text()
    for m in LINK.finditer(text):
        target = m.group(1)
        if "://" not in target and not target.startswith("mailto:"):
            yield target, doc.parent / target
    for m in CODE.finditer(text):
        path = m.group(1).rstrip(".,:;")
        # files (an extension) or folders (a trailing /), not patterns, commands or metric names
        is_path = path.endswith("/") or "." in path.rsplit("/", 1)[-1]
        if path.startswith(TOP) and is_path and not re.search(r"[*{}<>$=]", path):
            yield path, ROOT / path


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_path_the_docs_cite_exists(doc):
    missing = sorted({shown for shown, path in _targets(doc) if not path.exists()})
    assert not missing, f"{doc.relative_to(ROOT)} cites paths that do not exist: {missing}"


def test_no_patch_files_are_kept():
    """Losing variants are named by their commit, not kept as patches."""
    patches = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").rglob("*.patch"))
    assert not patches, f"delete these and cite the commit instead: {patches}"
