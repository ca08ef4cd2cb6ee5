"""The ``data`` config group: where text comes from, how it is tokenized and held out.

Also the Hydra structured-config schema of ``configs/data/*.yaml``, so every field is a plain typed
value. ``validate()`` runs on construction and again when a stream is built (Hydra fills the
fields after construction).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

# data.tokenizer / data.val_split values for a token corpus, filled in from its manifest at start
# (data/token_shards.apply_corpus_defaults): its own tokenizer, its 'val' split if it has one.
CORPUS_TOKENIZER = "corpus"
AUTO_SPLIT = "auto"

SOURCES = ("local", "hub", "tokens")
SHARDINGS = ("documents", "files")
LOCAL_FORMATS = ("parquet", "json", "text")
TEXT_SAMPLE_BY = ("line", "paragraph", "document")
_EXTENSION_FORMATS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".txt": "text"}


@dataclass
class DataConfig:
    name: str = "local"
    # "local": files on disk (parquet / jsonl / json / txt) through HF datasets;
    # "hub": a dataset on the Hugging Face hub (hf_name, hf_subset, split), streamed;
    # "tokens": pre-tokenized uint16/uint32 shards with a manifest.json (scripts/pretokenize.py,
    # scripts/build_corpus.py).
    source: str = "local"
    # local: files, folders or globs, comma-separated; tokens: the corpus folder (or its manifest.json).
    # Relative paths: under the working directory if they exist there, else under the project root.
    path: str = "offline/sample/train-*.parquet"
    # local only: parquet | json | text; None = from the file extension.
    format: str | None = None
    # txt files: one document per line, per blank-line-separated paragraph, or per file.
    text_sample_by: str = "paragraph"
    hf_name: str | None = None
    hf_subset: str | None = None
    hf_revision: str | None = None
    split: str = "train"
    text_column: str = "text"
    # hub name (e.g. HuggingFaceTB/SmolLM2-360M) or a local tokenizer folder; for a token corpus,
    # "corpus": the one its manifest records.
    tokenizer: str = "offline/tokenizer"
    # Held-out data, first match wins: files (local format), a named split (hub / tokens manifest),
    # or the first val_docs documents of the training source (skipped by training). For a token corpus,
    # val_split "auto": its 'val' split if it has one (then val_docs=0), else the val_docs head.
    val_path: str | None = None
    val_split: str | None = None
    val_docs: int = 0
    # hub: stream (True) or download the whole split to the HF cache first (False).
    streaming: bool = True
    shuffle: bool = True
    # documents are read in blocks of this many and each block is permuted (seed, epoch, block);
    # also the unit of re-reading on resume. Local file order is shuffled per epoch too.
    shuffle_buffer: int = 10_000
    add_eos: bool = True
    # most documents per tokenizer call (the fast tokenizer batches in Rust threads).
    tokenize_batch: int = 256
    # None: loop over the data forever (epochs are counted and logged).
    max_epochs: int | None = None
    # How the N = world_size * grad_accum lanes share the training data (docs/TRAINING.md, "Data"):
    # "documents": every rank reads the whole stream, document i goes to lane i mod N;
    # "files": parquet files / row groups (or a token corpus's shards) are split over the lanes once, so a
    # rank reads ~1/world_size of the bytes (local parquet, http(s):// or hf:// parquet URLs, a hub
    # dataset of parquet files, or data.source=tokens).
    sharding: str = "documents"
    # Remote reads (hub, http): attempts in all on HTTP 429 / 5xx / timeouts, and the first backoff
    # (doubled per attempt, full jitter, at most 60 s) before a clear error naming the file.
    retries: int = 8
    # micro-batches a background thread reads, tokenizes and packs ahead of the training loop
    # (data/prefetch.py); 0: on the training thread. Resume is exact for any value. Every configs/data group
    # sets it (4; shards 2: docs/RESULTS.md, "Data loading in the trainer"); a stream built in code has none.
    prefetch: int = 0
    retry_backoff_s: float = 1.0

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"data.source={self.source!r} is not one of {SOURCES}")
        if self.source == "hub" and not self.hf_name:
            raise ValueError(
                "data.source='hub' needs data.hf_name (e.g. data.hf_name=HuggingFaceFW/fineweb-edu)"
            )
        if self.source in ("local", "tokens") and not self.path:
            raise ValueError(f"data.source={self.source!r} needs data.path (files, a folder or a glob)")
        if self.format is not None and self.format not in LOCAL_FORMATS:
            raise ValueError(
                f"data.format={self.format!r} is not one of {LOCAL_FORMATS} (or null = by extension)"
            )
        if self.text_sample_by not in TEXT_SAMPLE_BY:
            raise ValueError(f"data.text_sample_by={self.text_sample_by!r} is not one of {TEXT_SAMPLE_BY}")
        if not self.text_column:
            raise ValueError("data.text_column is empty: name the column that holds the document text")
        if not self.tokenizer:
            raise ValueError("data.tokenizer is empty: give a hub name or a local tokenizer folder")
        if self.source != "tokens" and self.tokenizer == CORPUS_TOKENIZER:
            raise ValueError(
                f"data.tokenizer=corpus takes a token corpus's own tokenizer, but data.source={self.source!r}: "
                "give a hub name or a local tokenizer folder"
            )
        if self.source != "tokens" and self.val_split == AUTO_SPLIT:
            raise ValueError(
                f"data.val_split=auto picks a token corpus's 'val' split, but data.source={self.source!r}: "
                "name the split (or null)"
            )
        if self.sharding not in SHARDINGS:
            raise ValueError(f"data.sharding={self.sharding!r} is not one of {SHARDINGS}")
        if self.prefetch < 0:
            raise ValueError(f"data.prefetch={self.prefetch} must be >= 0 (0 = no background thread)")
        if self.retry_backoff_s < 0:
            raise ValueError(f"data.retry_backoff_s={self.retry_backoff_s} must be >= 0 (seconds)")
        for name in ("shuffle_buffer", "tokenize_batch", "retries"):
            if getattr(self, name) < 1:
                raise ValueError(f"data.{name}={getattr(self, name)} must be >= 1")
        if self.val_docs < 0:
            raise ValueError(
                f"data.val_docs={self.val_docs} must be >= 0 (0 = no held-out head of the stream)"
            )
        if self.max_epochs is not None and self.max_epochs < 1:
            raise ValueError(f"data.max_epochs={self.max_epochs} must be >= 1 or null (forever)")

    @classmethod
    def from_any(cls, cfg: Any) -> DataConfig:
        """A DataConfig from itself, a dict or an OmegaConf node (what Hydra hands to train.py)."""
        if isinstance(cfg, cls):
            cfg.validate()
            return cfg
        if not isinstance(cfg, Mapping):
            try:  # DictConfig is not a Mapping subclass everywhere; avoid importing omegaconf here
                cfg = dict(cfg.items())
            except AttributeError as err:
                raise TypeError(f"expected a DataConfig or a mapping, got {type(cfg).__name__}") from err
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(cfg) - known)
        if unknown:
            raise ValueError(f"unknown data config keys {unknown}; known keys: {sorted(known)}")
        return cls(**dict(cfg))

    def local_format(self, files: list[str]) -> str:
        """The datasets builder for local files: data.format, else from the first file's extension."""
        if self.format is not None:
            return self.format
        for ext, fmt in _EXTENSION_FORMATS.items():
            if files[0].endswith(ext):
                return fmt
        raise ValueError(
            f"cannot tell the format of {files[0]!r} from its extension (known: {sorted(_EXTENSION_FORMATS)}); "
            f"set data.format to one of {LOCAL_FORMATS}"
        )
