"""Pre-tokenized corpora on disk: flat uint16/uint32 token shards plus a manifest.json.

Each shard is the raw little-endian token array of its documents, every document followed by the
EOS id. The manifest records the tokenizer, EOS id, dtype and the shards of each split, so a
corpus built once (scripts/build_corpus.py) can be copied to a machine without internet.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from twell.data.paths import resolve_path

MANIFEST = "manifest.json"
FORMAT = "twell-token-shards"


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def read_manifest(path: str) -> tuple[Path, dict]:
    """(corpus folder, manifest) for a corpus folder or its manifest.json; clear error when absent."""
    target = resolve_path(path)
    manifest_path = target if target.name == MANIFEST else target / MANIFEST
    if not manifest_path.is_file():
        raise FileNotFoundError(
            f"data.path={path!r}: no token corpus manifest at {manifest_path}. "
            "Build one with `python scripts/build_corpus.py` (default output offline/corpus)."
        )
    manifest = json.loads(manifest_path.read_text())
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{manifest_path} is not a {FORMAT} manifest (format={manifest.get('format')!r})")
    return manifest_path.parent, manifest


def write_manifest(folder: Path, manifest: dict) -> Path:
    path = folder / MANIFEST
    path.write_text(json.dumps({"format": FORMAT, **manifest}, indent=2) + "\n")
    return path


class ShardDocuments:
    """The documents of one shard as views into a memory map (no copy until used)."""

    def __init__(self, file: Path, dtype: np.dtype, eos_id: int) -> None:
        self.tokens = np.memmap(file, dtype=dtype, mode="r")
        ends = np.flatnonzero(self.tokens == eos_id)
        # documents end at each EOS; trailing tokens without an EOS are a last document too
        if ends.size == 0 or ends[-1] != self.tokens.size - 1:
            ends = np.append(ends, self.tokens.size)
        self._starts = np.concatenate([[0], ends[:-1] + 1])
        self._ends = ends

    def __len__(self) -> int:
        return len(self._ends)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.tokens[self._starts[i] : self._ends[i]]


class ShardWriter:
    """Appends tokenized documents (each + EOS) to numbered shard files of one split."""

    def __init__(self, folder: Path, split: str, *, vocab_size: int, eos_id: int, shard_tokens: int) -> None:
        self.folder = folder
        self.split = split
        self.dtype = token_dtype(vocab_size)
        self.eos_id = eos_id
        self.shard_tokens = shard_tokens
        self.shards: list[dict] = []
        self._parts: list[np.ndarray] = []
        self._size = 0
        self._docs = 0

    def add(self, tokens) -> None:
        doc = np.asarray(tokens, dtype=self.dtype)
        if (doc == self.eos_id).any():
            doc = doc[doc != self.eos_id]  # an EOS inside a document would split it in two when read back
        self._parts.append(np.append(doc, np.array(self.eos_id, dtype=self.dtype)))
        self._size += doc.size + 1
        self._docs += 1
        if self._size >= self.shard_tokens:
            self.flush()

    def flush(self) -> None:
        if not self._parts:
            return
        name = f"{self.split}-{len(self.shards):05d}.bin"
        np.concatenate(self._parts).tofile(self.folder / name)
        self.shards.append({"file": name, "tokens": int(self._size), "documents": self._docs})
        self._parts, self._size, self._docs = [], 0, 0
