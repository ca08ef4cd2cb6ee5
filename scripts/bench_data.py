"""Loader throughput: tokens/s per rank and per node, from parquet text and from pre-tokenized shards.

    python scripts/bench_data.py --parquet 'fineweb/sample/10BT/*.parquet' --tokenizer HuggingFaceTB/SmolLM2-360M \\
        --procs 8 --workers 1,2,4 --out bench_data.json
    python scripts/bench_data.py --tokens offline/shards --procs 8 --out bench_data.json

Each case builds the training stream of ranks 0..P-1 (--procs, simulated as processes on this machine,
of --world-size ranks in all, default P) with build_train_stream, the trainer's code path (reading,
the tokenizer, packing into lanes), and times --batches micro-batches per rank (or --seconds,
whichever ends first) after one warm-up batch, all ranks at once. tokens/s per rank is the mean over
the ranks, per node the sum of their tokens over the slowest rank's time. --workers lists the
tokenizer threads a rank may use (RAYON_NUM_THREADS of its process: the Rust tokenizer encodes a batch
of documents on that many threads while the GIL is released); token shards need no tokenizer work.
Parquet text (local files in FineWeb's layout, or http(s):// / hf:// URLs) is read both ways,
data.sharding=documents (every rank reads the whole stream) and files (a rank reads its lanes' row
groups); a token corpus (scripts/pretokenize.py, scripts/build_corpus.py) both ways too. Cases that
need more row groups / shards than lanes are reported as skipped. Prints a table and writes JSON.
The issue-32 targets per rank: >= 270k tokens/s from parquet text with <= 4 workers, >= 5M from shards.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

from twell.data import DataConfig, build_train_stream, load_tokenizer


def time_rank(cfg: DataConfig, tokenizer, args, rank: int, barrier=None) -> dict:
    """One rank's stream: setup and warm-up, then (after every rank is ready) the timed batches."""
    started = time.perf_counter()
    stream = build_train_stream(
        cfg, tokenizer, args.seq_len, args.micro_batch, rank, args.world_size, args.grad_accum, seed=0
    )
    next(stream)  # opens the files, first tokenizer call
    setup_s = time.perf_counter() - started
    if barrier is not None:
        barrier.wait()
    tokens, batches, start = 0, 0, time.perf_counter()
    while batches < args.batches and time.perf_counter() - start < args.seconds:
        batch = next(stream)
        tokens += batch["input_ids"].numel()
        batches += 1
    elapsed = time.perf_counter() - start
    row = {"rank": rank, "batches": batches, "tokens": tokens, "seconds": elapsed, "setup_s": setup_s}
    row["tokens_per_s"] = tokens / elapsed if elapsed > 0 else 0.0
    if hasattr(stream, "bytes_read"):
        row["bytes_read"] = stream.bytes_read
    return row


def _rank_process(cfg_values: dict, tokenizer_name: str, args, rank: int, barrier, results) -> None:
    try:
        cfg = DataConfig(**cfg_values)
        results.put(time_rank(cfg, load_tokenizer(tokenizer_name), args, rank, barrier))
    except Exception as err:  # reported in the table; the other ranks must not wait forever
        barrier.abort()
        results.put({"rank": rank, "error": f"{type(err).__name__}: {err}"})


def run_case(cfg: DataConfig, args, workers: int | None) -> dict:
    """A row: the case's settings, each rank's timings, tokens/s per rank (mean) and per node."""
    row = {
        "source": cfg.source,
        "path": cfg.path,
        "sharding": cfg.sharding,
        "world_size": args.world_size,
        "procs": args.procs,
        "workers": workers,
        "grad_accum": args.grad_accum,
    }
    if args.procs == 1 and workers is None:  # in this process (fast; the tokenizer's default threads)
        try:
            ranks = [time_rank(cfg, load_tokenizer(cfg.tokenizer), args, 0)]
        except ValueError as err:  # e.g. fewer row groups than lanes for sharding=files
            ranks = [{"rank": 0, "error": f"ValueError: {err}"}]
    else:
        ranks = spawn_ranks(cfg, args, workers)
    errors = [r["error"] for r in ranks if "error" in r]
    if errors:
        print(f"skipped {cfg.source}/{cfg.sharding}: {errors[0]}", file=sys.stderr)
        return {**row, "skipped": errors[0]}
    seconds = max(r["seconds"] for r in ranks)
    row.update(
        batches=min(r["batches"] for r in ranks),
        tokens=sum(r["tokens"] for r in ranks),
        seconds=seconds,
        setup_s=max(r["setup_s"] for r in ranks),
        tokens_per_s_per_rank=sum(r["tokens_per_s"] for r in ranks) / len(ranks),
        tokens_per_s_per_node=sum(r["tokens"] for r in ranks) / seconds if seconds > 0 else 0.0,
        ranks=ranks,
    )
    if all("bytes_read" in r for r in ranks):
        row["bytes_read_per_rank"] = [r["bytes_read"] for r in ranks]
    return row


def spawn_ranks(cfg: DataConfig, args, workers: int | None) -> list[dict]:
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(args.procs), context.Queue()
    saved = os.environ.get("RAYON_NUM_THREADS")
    processes = []
    try:
        if workers is not None:  # a spawned process starts with this environment: its tokenizer's pool size
            os.environ["RAYON_NUM_THREADS"] = str(workers)
        for rank in range(args.procs):
            process = context.Process(
                target=_rank_process, args=(asdict(cfg), cfg.tokenizer, args, rank, barrier, results)
            )
            process.start()
            processes.append(process)
    finally:
        if saved is None:
            os.environ.pop("RAYON_NUM_THREADS", None)
        else:
            os.environ["RAYON_NUM_THREADS"] = saved
    ranks = [results.get(timeout=args.seconds + 900) for _ in processes]  # setup (hub reads) included
    for process in processes:
        process.join()
    return sorted(ranks, key=lambda r: r["rank"])


def cases(args) -> list[DataConfig]:
    configs = []
    for sharding in ("documents", "files"):
        if args.parquet:
            configs.append(
                DataConfig(
                    source="local",
                    path=args.parquet,
                    format="parquet",
                    text_column=args.text_column,
                    tokenizer=args.tokenizer or "offline/tokenizer",
                    sharding=sharding,
                    tokenize_batch=args.tokenize_batch,
                    prefetch=args.prefetch,
                )
            )
    if args.tokens:
        from twell.data.token_shards import read_manifest

        folder, manifest = read_manifest(args.tokens)
        beside = folder / "tokenizer"  # scripts/build_corpus.py keeps its tokenizer in the corpus folder
        tokenizer = args.tokenizer or str(beside if beside.is_dir() else manifest["tokenizer"])
        for sharding in ("documents", "files"):
            configs.append(
                DataConfig(
                    source="tokens",
                    path=args.tokens,
                    tokenizer=tokenizer,
                    sharding=sharding,
                    prefetch=args.prefetch,
                )
            )
    return configs


def print_table(rows: list[dict]) -> None:
    header = (
        f"{'source':7} {'sharding':10} {'ranks':>5} {'procs':>5} {'workers':>7} {'tokens/s/rank':>14} "
        f"{'tokens/s/node':>14} {'MB read/rank':>12}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        workers = "-" if row["workers"] is None else row["workers"]
        start = (
            f"{row['source']:7} {row['sharding']:10} {row['world_size']:>5} {row['procs']:>5} {workers:>7}"
        )
        if "skipped" in row:
            print(f"{start} skipped: {row['skipped'][:60]}")
            continue
        read = row.get("bytes_read_per_rank")
        mb = f"{max(read) / 1e6:12.1f}" if read else f"{'-':>12}"
        print(f"{start} {row['tokens_per_s_per_rank']:>14,.0f} {row['tokens_per_s_per_node']:>14,.0f} {mb}")


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parquet", help="parquet files (glob, folder, comma-separated, or URLs)")
    parser.add_argument("--tokens", help="token corpus folder (manifest.json + shards)")
    parser.add_argument(
        "--tokenizer", help="hub name or folder (parquet: default offline/tokenizer; tokens: the corpus's)"
    )
    parser.add_argument("--text-column", default="text")
    parser.add_argument("--procs", type=int, default=1, help="ranks simulated as processes on this node")
    parser.add_argument("--world-size", type=int, help="ranks the data is split over (default --procs)")
    parser.add_argument("--workers", help="tokenizer threads per rank, comma-separated (e.g. 1,2,4)")
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--batches", type=int, default=200, help="most micro-batches timed per rank")
    parser.add_argument("--seconds", type=float, default=20.0, help="most seconds timed per case")
    parser.add_argument("--tokenize-batch", type=int, default=256)
    parser.add_argument("--prefetch", type=int, default=0, help="data.prefetch of the streams")
    parser.add_argument("--out", default="bench_data.json")
    args = parser.parse_args(argv)
    if not (args.parquet or args.tokens):
        parser.error("give --parquet and/or --tokens")
    args.world_size = args.world_size or args.procs
    if not 1 <= args.procs <= args.world_size:
        parser.error(f"--procs {args.procs} must be in 1..--world-size ({args.world_size})")
    workers = [int(w) for w in args.workers.split(",")] if args.workers else [None]
    if any(w is not None and w < 1 for w in workers):
        parser.error(f"--workers {args.workers}: thread counts must be >= 1")

    rows = []
    for cfg in cases(args):
        # token shards do no tokenizer work: one row, whatever --workers says
        for count in workers if cfg.source != "tokens" else workers[:1]:
            rows.append(run_case(cfg, args, count))
    print_table(rows)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")
    return rows


if __name__ == "__main__":
    main()
