"""Tokenize a dataset once into memory-mapped token shards, in parallel over processes, for large runs.

    python scripts/pretokenize.py --data fineweb_edu --out /data/fineweb_edu_tokens --workers 16
    python scripts/pretokenize.py --path 'offline/sample/train-*.parquet' --tokenizer offline/tokenizer \\
        --out offline/shards --workers 2
    python train.py data=shards data.path=/data/fineweb_edu_tokens ...   # each lane reads its own shards

The text is read with the trainer's own code: parquet (local files in FineWeb's layout, http(s):// /
hf:// URLs, or the parquet files behind a hub dataset) row group by row group as data.sharding=files
reads it (data/sharded.py, with its retries); jsonl / txt files and hub datasets that are not parquet
through HF datasets (data/sources.py). It is tokenized as the text stream tokenizes it (no special
tokens; each document followed by EOS in the shard).

Work is cut into tasks: consecutive row groups of one parquet file up to --task-mib (uncompressed,
from the footers), or one jsonl / txt file, or (hub datasets that are not parquet) the whole stream.
--workers processes take tasks in turn; each writes its own shards ``{split}-{task:05d}-{part:05d}.bin``
of at most about --shard-tokens tokens (renamed into place when complete), then a record
``.done/{split}-{task:05d}.json``. A re-run skips every task whose record and shards are intact
(sizes; checksums too with --verify), so a killed run resumes where it stopped, and an output folder
of another source, tokenizer or setting is refused. Last, manifest.json lists the shards in source
order with token and document counts and sha256, the tokenizer (name, EOS id, vocabulary hash) and
the source files: the same corpus for any --workers.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, fields
from multiprocessing import get_context
from pathlib import Path

import yaml

from twell.data import DataConfig, load_tokenizer
from twell.data.paths import expand_files
from twell.data.sharded import NotParquetError, RowGroupSource, resolve_units
from twell.data.sources import TextSource
from twell.data.stream import text_encoder
from twell.data.token_shards import (
    ShardWriter,
    check_shard_files,
    file_sha256,
    token_dtype,
    vocab_hash,
    write_atomic,
    write_manifest,
)

ROOT = Path(__file__).resolve().parents[1]
BUILD = ".build.json"
DONE = ".done"
ENCODE_BATCH = 512  # documents per tokenizer call


def load_data_config(args) -> DataConfig:
    """--data (a configs/data name or a YAML file), then the flags given, as a DataConfig."""
    values = {}
    if args.data:
        path = Path(args.data)
        if not path.is_file():
            path = ROOT / "configs" / "data" / f"{args.data}.yaml"
        if not path.is_file():
            names = sorted(p.stem for p in (ROOT / "configs" / "data").glob("*.yaml"))
            raise SystemExit(f"--data {args.data!r}: no such file nor config name (configs/data: {names})")
        values = yaml.safe_load(path.read_text()) or {}
    for name in ("source", "path", "format", "hf_name", "hf_subset", "hf_revision", "split"):
        if getattr(args, name) is not None:
            values[name] = getattr(args, name)
    for name in ("text_column", "tokenizer", "retries"):
        if getattr(args, name) is not None:
            values[name] = getattr(args, name)
    if args.path and "source" not in values:
        values["source"] = "local"
    if args.val_path is None and values.get("val_path") and not values.get("source") == "hub":
        args.val_path = values["val_path"]  # the data config's held-out files become split "val"
    known = {f.name for f in fields(DataConfig)}
    # the whole split is tokenized in file order: the trainer's data.val_docs holds out the same head
    values.update(val_docs=0, val_path=None, val_split=None, shuffle=False, sharding="documents")
    cfg = DataConfig(**{k: v for k, v in values.items() if k in known})
    if cfg.source == "tokens":
        raise SystemExit("the source is already a token corpus (data.source=tokens): nothing to tokenize")
    return cfg


def plan_tasks(cfg: DataConfig, split: str, task_bytes: int) -> list[dict]:
    """The tasks of one split, in source order: row-group runs of parquet files, files, or one stream."""
    try:
        units = resolve_units(cfg)
    except NotParquetError:
        if cfg.source == "hub":
            return [
                {"split": split, "kind": "stream", "what": f"{cfg.hf_name} ({cfg.hf_subset}) {cfg.split}"}
            ]
        files = expand_files(cfg.path, "--path")
        return [{"split": split, "kind": "file", "file": f, "what": f} for f in files]
    tasks, run, size = [], [], 0
    for unit in units:
        if run and (unit["file"] != run[0]["file"] or size + unit["bytes"] > task_bytes):
            tasks.append(run)
            run, size = [], 0
        run.append(unit)
        size += unit["bytes"]
    tasks.append(run)
    return [
        {
            "split": split,
            "kind": "row_groups",
            "units": run,
            "what": f"{run[0]['file']} row groups {run[0]['row_group']}-{run[-1]['row_group']}",
        }
        for run in tasks
    ]


def task_name(task: dict) -> str:
    return f"{task['split']}-{task['id']:05d}"


def task_key(task: dict) -> str:
    return hashlib.sha256(json.dumps(task, sort_keys=True).encode()).hexdigest()[:16]


def open_task(cfg: DataConfig, task: dict):
    """The documents of a task, through the trainer's readers."""
    if task["kind"] == "row_groups":
        source = RowGroupSource(cfg, task["units"], task["id"], 0, False)
    elif task["kind"] == "file":
        source = TextSource(cfg, files=task["file"])
    else:
        source = TextSource(cfg, split=cfg.split)
    source.open(0, None)
    return source


_ENCODERS: dict[str, tuple] = {}


def _worker_start(threads: int) -> None:
    # before the tokenizer's first call: each worker's Rust thread pool gets its share of the cores
    os.environ["RAYON_NUM_THREADS"] = str(threads)


def run_task(cfg_values: dict, task: dict, out: str, shard_tokens: int) -> dict:
    """Tokenize one task into its shards and its record (in a worker process, or in this one)."""
    cfg = DataConfig(**cfg_values)
    if cfg.tokenizer not in _ENCODERS:
        tokenizer = load_tokenizer(cfg.tokenizer)
        _ENCODERS[cfg.tokenizer] = (tokenizer, text_encoder(tokenizer))
    tokenizer, encode = _ENCODERS[cfg.tokenizer]
    started = time.perf_counter()
    writer = ShardWriter(
        Path(out),
        task["split"],
        vocab_size=len(tokenizer),
        eos_id=tokenizer.eos_token_id,
        shard_tokens=shard_tokens,
        prefix=task_name(task),
    )
    source, docs, text_bytes = open_task(cfg, task), [], 0
    while True:
        doc = source.next_document()
        if doc is not None:
            docs.append(doc)
            text_bytes += len(doc.encode("utf-8"))
        if docs and (doc is None or len(docs) == ENCODE_BATCH):
            for tokens in encode(docs):
                writer.add(tokens)
            docs = []
        if doc is None:
            break
    writer.flush()
    record = {
        "key": task_key(task),
        "shards": writer.shards,
        "text_bytes": text_bytes,
        "seconds": round(time.perf_counter() - started, 3),
    }
    write_atomic(Path(out) / DONE / f"{task_name(task)}.json", (json.dumps(record, indent=1) + "\n").encode())
    return record


def finished(out: Path, task: dict, dtype, verify: bool) -> dict | None:
    """The task's record when it and its shards are intact, else None (the task is redone)."""
    path = out / DONE / f"{task_name(task)}.json"
    try:
        record = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if record.get("key") != task_key(task):
        return None
    try:
        check_shard_files(out, record["shards"], dtype)
    except (OSError, ValueError):
        return None
    if verify and any(file_sha256(out / s["file"]) != s["sha256"] for s in record["shards"]):
        return None
    return record


def check_build(out: Path, build: dict) -> None:
    """The output folder is new, or holds a build of the very same source, tokenizer and settings."""
    path = out / BUILD
    if path.is_file():
        saved = json.loads(path.read_text())
        if saved != build:
            changed = sorted(k for k in set(saved) | set(build) if saved.get(k) != build.get(k))
            raise SystemExit(
                f"--out {out} holds a build with other {changed} ({path}); give another --out, or delete "
                "the folder to start over"
            )
    out.mkdir(parents=True, exist_ok=True)
    (out / DONE).mkdir(exist_ok=True)
    write_atomic(path, (json.dumps(build, indent=1) + "\n").encode())


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", help="a configs/data name (fineweb_edu, local, ...) or a data YAML file")
    parser.add_argument("--source", choices=("local", "hub"))
    parser.add_argument("--path", help="local files: parquet / jsonl / txt, a folder or a glob (or URLs)")
    parser.add_argument("--format", choices=("parquet", "json", "text"))
    parser.add_argument("--hf-name")
    parser.add_argument("--hf-subset")
    parser.add_argument("--hf-revision")
    parser.add_argument("--split", help="the split to tokenize (default train)")
    parser.add_argument(
        "--val-path", help="local held-out files, tokenized as split 'val' (default: the --data config's)"
    )
    parser.add_argument("--text-column")
    parser.add_argument("--tokenizer", help="hub name or local folder (default: the data config's)")
    parser.add_argument("--retries", type=int)
    parser.add_argument("--out", required=True, help="output folder (shards + manifest.json)")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="processes (default: cores)")
    parser.add_argument(
        "--shard-tokens", type=int, default=2**26, help="tokens a shard holds at most (about)"
    )
    parser.add_argument("--task-mib", type=float, default=512.0, help="parquet text a task reads at most")
    parser.add_argument("--verify", action="store_true", help="re-hash finished shards before skipping them")
    args = parser.parse_args(argv)
    if args.workers < 1 or args.shard_tokens < 1 or args.task_mib <= 0:
        parser.error("--workers and --shard-tokens must be >= 1 and --task-mib > 0")

    cfg = load_data_config(args)
    tokenizer = load_tokenizer(cfg.tokenizer)
    tasks = plan_tasks(cfg, "train", int(args.task_mib * 2**20))
    if args.val_path:
        val_cfg = DataConfig(**{**asdict(cfg), "source": "local", "path": args.val_path})
        tasks += plan_tasks(val_cfg, "val", int(args.task_mib * 2**20))
    per_split: dict[str, int] = {}
    for task in tasks:
        task["id"] = per_split.get(task["split"], 0)
        per_split[task["split"]] = task["id"] + 1
    dtype = token_dtype(len(tokenizer))
    meta = {
        "tokenizer": cfg.tokenizer,
        "vocab_size": len(tokenizer),
        "eos_id": tokenizer.eos_token_id,
        "vocab_hash": vocab_hash(tokenizer),
        "dtype": dtype.name,
    }
    source = {
        k: v for k, v in asdict(cfg).items() if k in ("source", "path", "format", "hf_name", "hf_subset")
    }
    source.update(
        hf_revision=cfg.hf_revision, split=cfg.split, text_column=cfg.text_column, val_path=args.val_path
    )
    out = Path(args.out)
    check_build(out, {**meta, "source": source, "shard_tokens": args.shard_tokens, "tasks": task_key(tasks)})

    records = {task_name(t): finished(out, t, dtype, args.verify) for t in tasks}
    todo = [t for t in tasks if records[task_name(t)] is None]
    print(f"{len(tasks)} task(s), {len(tasks) - len(todo)} already finished; {len(todo)} to run on "
          f"{min(args.workers, max(1, len(todo)))} worker(s)")  # fmt: skip
    started, done_tokens = time.perf_counter(), 0
    cfg_values = asdict(cfg)

    def report(task, record):
        nonlocal done_tokens
        records[task_name(task)] = record
        done_tokens += sum(s["tokens"] for s in record["shards"])
        rate = done_tokens / max(1e-9, time.perf_counter() - started)
        print(f"  {task_name(task)}: {task['what']}: {sum(s['tokens'] for s in record['shards']):,} tokens "
              f"({rate:,.0f} tokens/s so far)", flush=True)  # fmt: skip

    task = None
    try:
        if args.workers == 1 or len(todo) <= 1:
            for task in todo:
                report(task, run_task(cfg_values, task, str(out), args.shard_tokens))
        else:
            workers = min(args.workers, len(todo))
            threads = max(1, (os.cpu_count() or 1) // workers)
            with ProcessPoolExecutor(
                workers, mp_context=get_context("spawn"), initializer=_worker_start, initargs=(threads,)
            ) as pool:
                futures = {pool.submit(run_task, cfg_values, t, str(out), args.shard_tokens): t for t in todo}
                for future in as_completed(futures):
                    task = futures[future]
                    report(task, future.result())
    except Exception as err:
        where = f" in task {task_name(task)} ({task['what']})" if task else ""
        raise SystemExit(
            f"pretokenize stopped{where}: {type(err).__name__}: {err}\nfinished tasks are kept in "
            f"{out / DONE}: run the same command again to resume"
        ) from err

    splits: dict[str, list[dict]] = {}
    for task in tasks:
        for shard in records[task_name(task)]["shards"]:
            splits.setdefault(task["split"], []).append({**shard, "source": task["what"]})
    sources = sorted(
        {u["file"] for t in tasks for u in t.get("units", [])} | {t["file"] for t in tasks if "file" in t}
    )
    manifest = {**meta, "splits": splits, "source": source, "source_files": sources,
                "built_by": "scripts/pretokenize.py"}  # fmt: skip
    write_manifest(out, manifest)
    elapsed = time.perf_counter() - started
    for split, shards in splits.items():
        tokens, docs = sum(s["tokens"] for s in shards), sum(s["documents"] for s in shards)
        print(f"{split}: {docs:,} documents, {tokens:,} tokens in {len(shards)} shard(s)")
    # data=shards takes the tokenizer and a 'val' split from the manifest (else it holds out the head
    # of the training split).
    print(f"wrote {out / 'manifest.json'} ({done_tokens:,} new tokens in {elapsed:.1f} s); "
          f"train with data=shards data.path={out}")  # fmt: skip
    return manifest


if __name__ == "__main__":
    main()
