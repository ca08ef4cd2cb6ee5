"""Pre-tokenized corpora on disk: flat uint16/uint32 token shards plus a manifest.json.

Each shard is the raw little-endian token array of its documents, every document followed by the
EOS id. The manifest records the tokenizer (name, EOS id, vocabulary size and a hash of its
vocabulary), the dtype and the shards of each split (file, tokens, documents, sha256), so a corpus
built once (scripts/pretokenize.py from parquet / jsonl / a hub dataset, or scripts/build_corpus.py)
can be copied to a machine without internet. Readers check the tokenizer and the shard sizes when
they open a corpus and a shard's checksum the first time a process reads it.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from twell.data.config import AUTO_SPLIT, CORPUS_TOKENIZER
from twell.data.paths import resolve_path

MANIFEST = "manifest.json"
FORMAT = "twell-token-shards"
_REBUILD = "rebuild it (scripts/pretokenize.py re-writes only the shards that are missing or corrupt)"
_VERIFIED: set[tuple[str, int, int]] = set()  # (path, size, mtime) whose sha256 matched, per process


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def vocab_hash(tokenizer) -> str:
    """A short hash of a tokenizer's vocabulary (token -> id, added tokens included)."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()[:16]


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()  # chunked by hand: hashlib.file_digest is Python 3.11+, we support 3.10
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_atomic(path: Path, data: bytes) -> None:
    """Write beside `path`, then rename over it: a reader (or a re-run) never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def read_manifest(path: str) -> tuple[Path, dict]:
    """(corpus folder, manifest) for a corpus folder or its manifest.json; clear error when absent."""
    target = resolve_path(path)
    manifest_path = target if target.name == MANIFEST else target / MANIFEST
    if not manifest_path.is_file():
        raise FileNotFoundError(
            f"data.path={path!r}: no token corpus manifest at {manifest_path}. Build one with "
            "`python scripts/pretokenize.py --out ...` (or scripts/build_corpus.py, output offline/corpus)."
        )
    try:
        manifest = json.loads(manifest_path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{manifest_path} is not valid JSON ({err}); {_REBUILD}") from err
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{manifest_path} is not a {FORMAT} manifest (format={manifest.get('format')!r})")
    return manifest_path.parent, manifest


def apply_corpus_defaults(cfg) -> list[str]:
    """For a token corpus (data.source=tokens), fill in, in place, what its manifest knows:
    data.tokenizer=corpus -> the tokenizer it was built with (a local folder found like the data paths,
    else the hub name as recorded); data.val_split=auto -> its 'val' split when it has one (the training
    split then keeps every document: data.val_docs=0), else no split (data.val_docs holds out the head
    of the training split). Returns one line per value filled in, for the run's log."""
    if cfg.source != "tokens" or (cfg.tokenizer != CORPUS_TOKENIZER and cfg.val_split != AUTO_SPLIT):
        return []
    folder, manifest = read_manifest(cfg.path)
    notes = []
    if cfg.tokenizer == CORPUS_TOKENIZER:
        built = manifest.get("tokenizer")
        if not built:
            raise ValueError(
                f"data.tokenizer=corpus: the manifest of {folder} records no tokenizer; set data.tokenizer "
                "to the one the corpus was built with"
            )
        local = resolve_path(built)
        cfg.tokenizer = str(local) if local.exists() else built
        notes.append(f"data.tokenizer={cfg.tokenizer} (the corpus's)")
    if cfg.val_split == AUTO_SPLIT:
        if manifest["splits"].get("val"):
            cfg.val_split, cfg.val_docs = "val", 0
            notes.append("data.val_split=val (the corpus's held-out split), data.val_docs=0")
        else:
            cfg.val_split = None
            notes.append(
                f"data.val_split: none in the corpus, the first data.val_docs={cfg.val_docs} documents"
            )
    return notes


def write_manifest(folder: Path, manifest: dict) -> Path:
    path = folder / MANIFEST
    write_atomic(path, (json.dumps({"format": FORMAT, **manifest}, indent=2) + "\n").encode())
    return path


def manifest_dtype(manifest: dict) -> np.dtype:
    return np.dtype(manifest.get("dtype") or token_dtype(manifest["vocab_size"]))


def check_tokenizer(folder: Path, manifest: dict, tokenizer) -> None:
    """The corpus was tokenized with `tokenizer` (EOS id, vocabulary size, vocabulary hash when recorded)."""
    built = manifest.get("tokenizer")
    fix = f"set data.tokenizer={built} (the corpus's tokenizer) or re-tokenize the corpus with this one"
    eos_id = tokenizer.eos_token_id
    if eos_id != manifest["eos_id"]:
        raise ValueError(
            f"token corpus {folder} was built with EOS id {manifest['eos_id']} ({built}), but the "
            f"tokenizer's EOS id is {eos_id}: {fix}"
        )
    if manifest["vocab_size"] > len(tokenizer):
        raise ValueError(
            f"token corpus {folder} has vocab_size {manifest['vocab_size']} > the tokenizer's "
            f"{len(tokenizer)}: {fix}"
        )
    if manifest.get("vocab_hash") and manifest["vocab_hash"] != vocab_hash(tokenizer):
        raise ValueError(
            f"token corpus {folder} was tokenized with {built} (vocabulary hash {manifest['vocab_hash']}), "
            f"not with this run's tokenizer (hash {vocab_hash(tokenizer)}): {fix}"
        )


def check_shard_files(folder: Path, shards: list[dict], dtype: np.dtype) -> None:
    """Every shard is there with the size its token count says (a cheap stat, at start)."""
    missing, wrong = [], []
    for shard in shards:
        file = folder / shard["file"]
        if not file.is_file():
            missing.append(shard["file"])
        elif file.stat().st_size != shard["tokens"] * dtype.itemsize:
            wrong.append(
                f"{shard['file']} ({file.stat().st_size} bytes, expected {shard['tokens'] * dtype.itemsize})"
            )
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise FileNotFoundError(f"token corpus {folder} lacks shard files {missing[:3]}{more}; {_REBUILD}")
    if wrong:
        more = f" and {len(wrong) - 3} more" if len(wrong) > 3 else ""
        raise ValueError(f"token corpus {folder} has shards of the wrong size: {wrong[:3]}{more}; {_REBUILD}")


def verify_shard(file: Path, sha256: str | None) -> None:
    """The shard's checksum matches the manifest's (once per process and file version)."""
    if not sha256:
        return
    stat = file.stat()
    key = (str(file), stat.st_size, stat.st_mtime_ns)
    if key in _VERIFIED:
        return
    actual = file_sha256(file)
    if actual != sha256:
        raise ValueError(
            f"token shard {file} is corrupt: sha256 {actual[:16]}... != manifest's {sha256[:16]}...; {_REBUILD}"
        )
    _VERIFIED.add(key)


class ShardDocuments:
    """The documents of one shard as views into a memory map (no copy until used)."""

    def __init__(self, file: Path, dtype: np.dtype, eos_id: int, sha256: str | None = None) -> None:
        verify_shard(file, sha256)
        self.tokens = np.memmap(file, dtype=dtype, mode="r") if file.stat().st_size else np.zeros(0, dtype)
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
    """Appends tokenized documents (each + EOS) to numbered shard files of one split.

    Shards are named ``{prefix}-{n:05d}.bin`` (prefix: the split by default), written beside their
    final name and renamed when complete; each record carries its sha256."""

    def __init__(
        self,
        folder: Path,
        split: str,
        *,
        vocab_size: int,
        eos_id: int,
        shard_tokens: int,
        prefix: str | None = None,
    ) -> None:
        self.folder = folder
        self.split = split
        self.prefix = prefix or split
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
        name = f"{self.prefix}-{len(self.shards):05d}.bin"
        data = np.concatenate(self._parts).astype(self.dtype.newbyteorder("<"), copy=False).tobytes()
        write_atomic(self.folder / name, data)
        self.shards.append(
            {
                "file": name,
                "tokens": int(self._size),
                "documents": self._docs,
                "sha256": hashlib.sha256(data).hexdigest(),
            }
        )
        self._parts, self._size, self._docs = [], 0, 0
