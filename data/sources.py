"""Document sources: an ordered, resumable sequence of documents per epoch.

A source opens an epoch (optionally at a saved position), returns documents one at a time
(text for HF datasets, token arrays for pre-tokenized shards) and reports its position after
the last document it returned. Positions are small dicts of plain values (checkpoint-friendly).

Text goes through HF ``datasets`` streaming in every case (``load_dataset("parquet"|"json"|"text",
data_files=...)`` for local files, ``load_dataset(hf_name, hf_subset, ...)`` for the hub), so local
tests exercise the code path users hit with the hub; positions are ``IterableDataset.state_dict()``.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np

from twell.data.config import DataConfig
from twell.data.paths import expand_files, is_url
from twell.data.retry import is_retryable, with_retries
from twell.data.token_shards import (
    ShardDocuments,
    check_shard_files,
    check_tokenizer,
    manifest_dtype,
    read_manifest,
)

log = logging.getLogger(__name__)


class TextSource:
    """Documents of a local file set or a hub split, read with HF datasets."""

    tokenized = False

    def __init__(
        self,
        cfg: DataConfig,
        *,
        files: str | None = None,
        split: str | None = None,
        seed: int = 0,
        shuffle_files: bool = False,
    ) -> None:
        self.cfg = cfg
        self.split = split or cfg.split
        self.seed = seed
        self.shuffle_files = shuffle_files
        if cfg.source == "local" or files is not None:
            self.files = expand_files(files or cfg.path, "data.val_path" if files else "data.path")
            self.format = cfg.local_format(self.files)
            where = "remote" if is_url(self.files[0]) else "local"
            self.description = f"{len(self.files)} {where} {self.format} file(s) ({self.files[0]}, ...)"
        else:
            self.files = None
            self.description = f"hub dataset {cfg.hf_name} ({cfg.hf_subset or 'default'}, split {self.split})"
        self._dataset = None
        self._iterator = None
        self._epoch = 0
        self._resume_at = None
        self._check_text_column()

    def _build(self, epoch: int):
        from datasets import load_dataset  # import here: the GPU image carries datasets as a wheel

        if self.files is not None:
            files = list(self.files)
            if self.shuffle_files:
                files = [files[i] for i in np.random.default_rng([self.seed, epoch]).permutation(len(files))]
            empty = [f for f in files if not is_url(f) and os.path.getsize(f) == 0]
            if empty:
                more = f" (and {len(empty) - 1} more)" if len(empty) > 1 else ""
                raise ValueError(
                    f"data file {empty[0]} is empty (0 bytes){more}; fill it or leave it out of "
                    "data.path / data.val_path"
                )
            extra = {"sample_by": self.cfg.text_sample_by} if self.format == "text" else {}
            try:
                return load_dataset(
                    self.format, data_files={"train": files}, split="train", streaming=True, **extra
                )
            except StopIteration:  # datasets' json/text readers on a file without any record
                raise ValueError(f"{self.description} holds no documents; check data.path") from None
        try:
            dataset = load_dataset(
                self.cfg.hf_name,
                self.cfg.hf_subset,
                split=self.split,
                revision=self.cfg.hf_revision,
                streaming=self.cfg.streaming,
            )
        except Exception as err:  # datasets raises many types (ConnectionError, DatasetNotFoundError, ...)
            offline = os.environ.get("HF_DATASETS_OFFLINE", os.environ.get("HF_HUB_OFFLINE", "0")) in (
                "1",
                "true",
            )
            hint = " (HF_DATASETS_OFFLINE/HF_HUB_OFFLINE is set and it is not cached)" if offline else ""
            raise ValueError(
                f"cannot open {self.description}{hint}: {err}. Fix the name/subset/split, run with internet, or "
                "use local data: data=local (after `python scripts/prepare_offline_data.py`) or data.source=tokens."
            ) from err
        return dataset if self.cfg.streaming else dataset.to_iterable_dataset()

    def _retry(self, fn):
        return with_retries(
            fn, what=self.description, tries=self.cfg.retries, backoff_s=self.cfg.retry_backoff_s
        )

    def _check_text_column(self) -> None:
        def first_record():
            dataset = self._build(epoch=0)
            return dataset.column_names, next(iter(dataset), None)

        columns, first = self._retry(first_record)
        if first is None:
            raise ValueError(f"{self.description} holds no documents")
        columns = columns or list(first)
        if self.cfg.text_column not in first:
            raise ValueError(
                f"{self.description} has no {self.cfg.text_column!r} column (columns: {columns}); "
                f"set data.text_column to the column that holds the document text"
            )
        if not isinstance(first[self.cfg.text_column], str):
            raise ValueError(
                f"column {self.cfg.text_column!r} of {self.description} holds "
                f"{type(first[self.cfg.text_column]).__name__}, not text; set data.text_column"
            )

    def open(self, epoch: int, position: dict[str, Any] | None) -> None:
        self._epoch = epoch
        self._retry(lambda: self._open(epoch, position))

    def _open(self, epoch: int, position: dict[str, Any] | None) -> None:
        self._dataset = self._build(epoch)
        if position is not None:
            self._dataset.load_state_dict(position)
        self._iterator = iter(self._dataset)

    def next_document(self) -> str | None:
        """The next document; a failed remote read re-opens the files at the last position (as a resume does)."""
        try:
            return self._next()
        except Exception as err:
            if not is_retryable(err):
                raise
            failed = err

        def reopen_then_read():
            if self._iterator is None:
                self._open(self._epoch, self._resume_at)
            return self._next()

        return with_retries(
            reopen_then_read,
            what=self.description,
            tries=self.cfg.retries,
            backoff_s=self.cfg.retry_backoff_s,
            failed=failed,
        )

    def _next(self) -> str | None:
        try:
            return next(self._iterator)[self.cfg.text_column]
        except StopIteration:
            return None
        except Exception as err:
            if is_retryable(err):  # the next attempt re-opens where the last document ended
                self._resume_at = self._dataset.state_dict()
                self._iterator = None
            raise

    def position(self) -> dict[str, Any]:
        return self._dataset.state_dict()


class TokenShardSource:
    """Documents of a pre-tokenized corpus (token arrays without their EOS)."""

    tokenized = True

    def __init__(
        self,
        cfg: DataConfig,
        *,
        split: str | None = None,
        seed: int = 0,
        shuffle_files: bool = False,
        tokenizer=None,
    ) -> None:
        self.folder, self.manifest = read_manifest(cfg.path)
        self.split = split or cfg.split
        splits = self.manifest["splits"]
        if self.split not in splits or not splits[self.split]:
            raise ValueError(
                f"token corpus {self.folder} has no split {self.split!r} (splits: {sorted(splits)}); "
                "set data.split / data.val_split to one of them"
            )
        if tokenizer is not None:
            check_tokenizer(self.folder, self.manifest, tokenizer)
        self.dtype = manifest_dtype(self.manifest)
        self.records = splits[self.split]
        check_shard_files(self.folder, self.records, self.dtype)
        self.shards = [self.folder / shard["file"] for shard in self.records]
        self.seed = seed
        self.shuffle_files = shuffle_files
        self.description = f"token corpus {self.folder} (split {self.split}, {len(self.shards)} shard(s))"
        self._order: list[int] = []
        self._shard = 0
        self._doc = 0
        self._docs: ShardDocuments | None = None

    def open(self, epoch: int, position: dict[str, Any] | None) -> None:
        order = np.arange(len(self.shards))
        if self.shuffle_files:
            order = np.random.default_rng([self.seed, epoch]).permutation(len(self.shards))
        self._order = [int(i) for i in order]
        self._shard = position["shard"] if position else 0
        self._doc = position["doc"] if position else 0
        self._docs = None

    def next_document(self) -> np.ndarray | None:
        while self._shard < len(self._order):
            if self._docs is None:
                index = self._order[self._shard]
                self._docs = ShardDocuments(
                    self.shards[index], self.dtype, self.manifest["eos_id"], self.records[index].get("sha256")
                )
            if self._doc < len(self._docs):
                doc = self._docs[self._doc]
                self._doc += 1
                return doc
            self._shard, self._doc, self._docs = self._shard + 1, 0, None
        return None

    def position(self) -> dict[str, Any]:
        return {"shard": self._shard, "doc": self._doc}


def open_source(cfg: DataConfig, role: str, *, seed: int, tokenizer):
    """The source for role "train" or "val" (val: data.val_path, data.val_split, else the train source);
    a token corpus is checked against `tokenizer`."""
    shuffle = cfg.shuffle and role == "train" and cfg.val_docs == 0  # a held-out head needs a fixed order
    if cfg.source == "tokens":
        split = cfg.val_split if role == "val" and cfg.val_split else cfg.split
        return TokenShardSource(cfg, split=split, seed=seed, shuffle_files=shuffle, tokenizer=tokenizer)
    if role == "val" and cfg.val_path:
        return TextSource(cfg, files=cfg.val_path, seed=seed)
    split = cfg.val_split if role == "val" and cfg.val_split else cfg.split
    return TextSource(cfg, split=split, seed=seed, shuffle_files=shuffle)
