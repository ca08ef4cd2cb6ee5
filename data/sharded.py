"""Sharded reading (data.sharding=files): each lane reads its own parquet row groups or token shards.

The source's files (local parquet, http(s):// / hf:// URLs, or the parquet files behind a hub
dataset) are resolved once (rank 0, then broadcast) into units, one per row group, in the source's
file order; a pre-tokenized corpus (data.source=tokens) has one unit per shard of its split, in the
manifest's order, and a lane reads its shards through memory maps. The held-out head (data.val_docs) is cut off the front. Units are dealt to the
N = world_size * grad_accum lanes by size (largest first, each to the lane with the fewest bytes so
far), so a rank, which serves grad_accum lanes, reads about 1/world_size of the bytes.

A lane reads its units in order (shuffled per epoch with (seed, epoch, lane)) through fsspec and
pyarrow, row group by row group, and a DocumentReader shuffles its documents in blocks, as in the
documents layout. Positions are (unit, row): a resume, or a retry after a failed read, re-opens
the file at that row group and skips to that row. The lane guarantee is unchanged: the lanes depend
only on N and the seed, so the global batch of a step is the same for every world_size x grad_accum
with the same product.
"""

from __future__ import annotations

import hashlib
import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from twell.data.config import DataConfig
from twell.data.paths import expand_files
from twell.data.retry import with_retries
from twell.data.token_shards import ShardDocuments, check_shard_files, manifest_dtype, read_manifest


def _open_parquet(file: str):
    import fsspec
    import pyarrow.parquet as pq

    fs, path = fsspec.core.url_to_fs(file)
    handle = fs.open(path, "rb")
    try:
        return handle, pq.ParquetFile(handle)
    except BaseException:
        handle.close()
        raise


class NotParquetError(ValueError):
    """The source is not a set of parquet files (so it has no row groups to split)."""


def source_files(cfg: DataConfig) -> list[str]:
    """The training split's parquet files, in the order the documents layout reads them."""
    if cfg.source == "local":
        files = expand_files(cfg.path, "data.path")
        if cfg.local_format(files) != "parquet":
            raise NotParquetError(
                f"data.sharding=files reads parquet row groups, but {files[0]} is {cfg.local_format(files)}; "
                "convert the files to parquet or set data.sharding=documents"
            )
        return files
    from datasets import load_dataset_builder

    try:
        builder = load_dataset_builder(cfg.hf_name, cfg.hf_subset, revision=cfg.hf_revision)
    except Exception as err:
        raise ValueError(
            f"cannot resolve the files of hub dataset {cfg.hf_name} ({cfg.hf_subset or 'default'}): {err}. "
            "Fix the name/subset, run with internet, or use local data."
        ) from err
    data_files = builder.config.data_files or {}
    if builder.name != "parquet" or cfg.split not in data_files:
        raise NotParquetError(
            f"hub dataset {cfg.hf_name} ({cfg.hf_subset or 'default'}) is not a set of parquet files with a "
            f"{cfg.split!r} split (builder {builder.name!r}, splits {sorted(data_files)}); "
            "set data.sharding=documents"
        )
    return [str(f) for f in data_files[cfg.split]]


def resolve_units(cfg: DataConfig) -> list[dict[str, Any]]:
    """Row groups of the training files: {"file", "row_group", "start", "rows", "bytes"}, or the shards of
    a token corpus: {"file" (in the corpus folder), "start", "rows" (documents), "bytes"}; head cut off."""
    units, what = _token_units(cfg) if cfg.source == "tokens" else _row_group_units(cfg)
    head = cfg.val_docs
    while head and units:
        unit = units[0]
        take = min(head, unit["rows"] - unit["start"])
        unit["start"] += take
        head -= take
        if unit["start"] == unit["rows"]:
            units.pop(0)
    if head or not units:
        raise ValueError(
            f"{what} hold(s) no training documents after the held-out head "
            f"(data.val_docs={cfg.val_docs}); add data or lower data.val_docs"
        )
    return units


def _token_units(cfg: DataConfig) -> tuple[list[dict[str, Any]], str]:
    folder, manifest = read_manifest(cfg.path)
    records = manifest["splits"].get(cfg.split)
    if not records:
        raise ValueError(
            f"token corpus {folder} has no split {cfg.split!r} (splits: {sorted(manifest['splits'])}); "
            "set data.split to one of them"
        )
    dtype = manifest_dtype(manifest)
    check_shard_files(folder, records, dtype)
    units = [
        {"file": r["file"], "start": 0, "rows": r["documents"], "bytes": r["tokens"] * dtype.itemsize}
        for r in records
        if r["documents"]
    ]
    return units, f"token corpus {folder} (split {cfg.split}, {len(records)} shard(s))"


def _row_group_units(cfg: DataConfig) -> tuple[list[dict[str, Any]], str]:
    files = source_files(cfg)

    def footer(file):
        def read():
            handle, parquet = _open_parquet(file)
            with handle:
                meta = parquet.metadata
                columns = parquet.schema_arrow.names
                return columns, [
                    (meta.row_group(i).num_rows, meta.row_group(i).total_byte_size)
                    for i in range(meta.num_row_groups)
                ]

        columns, groups = with_retries(read, what=file, tries=cfg.retries, backoff_s=cfg.retry_backoff_s)
        if cfg.text_column not in columns:
            raise ValueError(
                f"{file} has no {cfg.text_column!r} column (columns: {columns}); "
                "set data.text_column to the column that holds the document text"
            )
        return groups

    # one footer per file: a hub split has hundreds, fetched a few at a time
    with ThreadPoolExecutor(max_workers=min(16, len(files))) as pool:
        footers = list(pool.map(footer, files))
    units = [
        {"file": file, "row_group": index, "start": 0, "rows": rows, "bytes": size}
        for file, groups in zip(files, footers)
        for index, (rows, size) in enumerate(groups)
        if rows
    ]
    return units, f"{len(files)} parquet file(s) ({files[0]}, ...)"


def resolve_units_once(cfg: DataConfig, world_size: int) -> list[dict[str, Any]]:
    """resolve_units on rank 0, broadcast to the other ranks (errors too), when torch.distributed is up."""
    import torch.distributed as dist

    if world_size == 1 or not (dist.is_available() and dist.is_initialized()):
        return resolve_units(cfg)
    message: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            message[0] = ("ok", resolve_units(cfg))
        except Exception as err:
            message[0] = ("error", f"{type(err).__name__}: {err}")
    dist.broadcast_object_list(message, src=0)
    status, value = message[0]
    if status == "error":
        raise ValueError(f"rank 0 could not resolve the data files: {value}")
    return value


def split_units(units: list[dict[str, Any]], num_lanes: int) -> list[dict[str, Any]]:
    """Token shards for at least num_lanes lanes: while there are fewer units than lanes, the unit with the
    most bytes is cut in two at its middle document (a lane then reads a document range of a shard, through
    the same memory map; bytes estimated by documents). A corpus of a few large shards thus trains with
    any number of lanes (the paper's 1M-token steps of 8 x 2048 are 64 lanes). Deterministic: every rank
    and a resumed run cut the same way. Parquet row groups are left whole (a cut one would be read by two
    lanes): assign_units names the fix."""
    if not units or "row_group" in units[0] or len(units) >= num_lanes:
        return units
    units = [dict(unit) for unit in units]
    while len(units) < num_lanes:
        index = max(range(len(units)), key=lambda i: (units[i]["bytes"], -i))
        unit = units[index]
        docs = unit["rows"] - unit["start"]
        if docs < 2:  # every unit is one document: assign_units reports it
            break
        middle = unit["start"] + docs // 2
        first = {**unit, "rows": middle, "bytes": unit["bytes"] * (docs // 2) // docs}
        units[index : index + 1] = [first, {**unit, "start": middle, "bytes": unit["bytes"] - first["bytes"]}]
    return units


def assign_units(units: list[dict[str, Any]], num_lanes: int) -> list[list[int]]:
    """Unit indices per lane, balanced by bytes (largest first to the lightest lane); each in file order."""
    if len(units) < num_lanes:
        shards = units and "row_group" not in units[0]
        kind, what, fix = (
            ("token", "document", "use more data")
            if shards
            else ("parquet", "row group", "write the files with smaller row groups, use more files")
        )
        raise ValueError(
            f"data.sharding=files needs at least one {kind} {what} per lane, but the data has "
            f"{len(units)} {what}(s) for {num_lanes} lanes (world_size * grad_accum); {fix}, "
            "or set data.sharding=documents"
        )
    load = [0] * num_lanes
    lanes: list[list[int]] = [[] for _ in range(num_lanes)]
    for index in sorted(range(len(units)), key=lambda i: (-units[i]["bytes"], i)):
        lane = min(range(num_lanes), key=lambda j: (load[j], j))
        lanes[lane].append(index)
        load[lane] += units[index]["bytes"]
    return [sorted(lane) for lane in lanes]


def fingerprint(units: list[dict[str, Any]]) -> str:
    """Identifies the unit list in a saved state (a changed file set would move every position)."""
    return hashlib.sha256(json.dumps(units, sort_keys=True).encode()).hexdigest()[:16]


class RowGroupSource:
    """One lane's documents: the text column of its parquet row groups, read with retries.

    ``bytes_read`` (the row groups' sizes in the footer, all columns, uncompressed) and ``rows_read``
    count the row groups read, for tests and the benchmark."""

    tokenized = False

    def __init__(self, cfg: DataConfig, units: list[dict[str, Any]], lane: int, seed: int, shuffle: bool):
        self.cfg = cfg
        self.units = units
        self.lane = lane
        self.seed = seed
        self.shuffle = shuffle
        self.description = f"lane {lane}'s {len(units)} parquet row group(s) ({units[0]['file']}, ...)"
        self.bytes_read = 0
        self.rows_read = 0
        self._order: list[int] = []
        self._unit = 0
        self._row = 0
        self._texts: list[str] | None = None
        self._file: tuple[str, Any, Any] | None = None  # (name, handle, ParquetFile) kept across row groups

    def open(self, epoch: int, position: dict[str, Any] | None) -> None:
        self._order = lane_order(len(self.units), self.seed, epoch, self.lane, self.shuffle)
        self._unit = position["unit"] if position else 0
        self._row = position["row"] if position else 0
        self._texts = None

    def next_document(self) -> str | None:
        while self._unit < len(self._order):
            if self._texts is None:
                self._texts = self._read(self.units[self._order[self._unit]])
            if self._row < len(self._texts):
                text = self._texts[self._row]
                self._row += 1
                return text
            self._unit, self._row, self._texts = self._unit + 1, 0, None
        self._close()
        return None

    def position(self) -> dict[str, Any]:
        return {"unit": self._unit, "row": self._row}

    def _read(self, unit: dict[str, Any]) -> list[str]:
        def read():
            try:
                if self._file is None or self._file[0] != unit["file"]:
                    self._close()
                    self._file = (unit["file"], *_open_parquet(unit["file"]))
                return self._file[2].read_row_group(unit["row_group"], columns=[self.cfg.text_column])
            except Exception:
                self._close()  # the next attempt re-opens the file
                raise

        table = with_retries(
            read, what=unit["file"], tries=self.cfg.retries, backoff_s=self.cfg.retry_backoff_s
        )
        column = table.column(self.cfg.text_column)
        self.bytes_read += unit["bytes"]
        self.rows_read += unit["rows"]
        texts = column.to_pylist()[unit["start"] :]
        if texts and not isinstance(texts[0], str):
            raise ValueError(
                f"column {self.cfg.text_column!r} of {unit['file']} holds {type(texts[0]).__name__}, "
                "not text; set data.text_column"
            )
        return texts

    def _close(self) -> None:
        if self._file is not None:
            self._file[1].close()
            self._file = None


class ShardUnitSource:
    """One lane's documents from a token corpus: its shards, memory-mapped, checksums checked on first use.

    Same positions (unit, document) and counters as RowGroupSource."""

    tokenized = True

    def __init__(self, cfg: DataConfig, units: list[dict[str, Any]], lane: int, seed: int, shuffle: bool):
        self.folder, manifest = read_manifest(cfg.path)
        self.dtype = manifest_dtype(manifest)
        self.eos_id = manifest["eos_id"]
        self.sha256 = {r["file"]: r.get("sha256") for r in manifest["splits"][cfg.split]}
        self.units = units
        self.lane = lane
        self.seed = seed
        self.shuffle = shuffle
        self.description = (
            f"lane {lane}'s {len(units)} token shard(s) ({self.folder / units[0]['file']}, ...)"
        )
        self.bytes_read = 0
        self.rows_read = 0
        self._order: list[int] = []
        self._unit = 0
        self._row = 0
        self._docs: ShardDocuments | None = None

    def open(self, epoch: int, position: dict[str, Any] | None) -> None:
        self._order = lane_order(len(self.units), self.seed, epoch, self.lane, self.shuffle)
        self._unit = position["unit"] if position else 0
        self._row = position["row"] if position else 0
        self._docs = None

    def next_document(self):
        while self._unit < len(self._order):
            unit = self.units[self._order[self._unit]]
            if self._docs is None:
                self._docs = ShardDocuments(
                    self.folder / unit["file"], self.dtype, self.eos_id, self.sha256.get(unit["file"])
                )
                self.bytes_read += unit["bytes"]
                self.rows_read += unit["rows"] - unit["start"]
            # rows count from the unit's start (after a held-out head, or where split_units cut the
            # shard), as for parquet; the unit ends at document "rows"
            if unit["start"] + self._row < min(unit["rows"], len(self._docs)):
                doc = self._docs[unit["start"] + self._row]
                self._row += 1
                return doc
            self._unit, self._row, self._docs = self._unit + 1, 0, None
        return None

    def position(self) -> dict[str, Any]:
        return {"unit": self._unit, "row": self._row}


def lane_order(count: int, seed: int, epoch: int, lane: int, shuffle: bool) -> list[int]:
    """The order a lane reads its units in an epoch: shuffled with (seed, epoch, lane), or as given."""
    order = np.arange(count)
    if shuffle:
        order = np.random.default_rng([seed, epoch, lane]).permutation(count)
    return [int(i) for i in order]


def lane_source(cfg: DataConfig, units: list[dict[str, Any]], lane: int, seed: int):
    """The source of one lane's units: token shards (data.source=tokens) or parquet row groups."""
    kind = ShardUnitSource if cfg.source == "tokens" else RowGroupSource
    return kind(cfg, units, lane, seed, cfg.shuffle)
