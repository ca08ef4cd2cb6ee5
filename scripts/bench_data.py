"""Loader throughput: tokens/s one rank's training stream serves, from parquet text and from token shards.

    python scripts/bench_data.py --parquet 'fineweb/sample/10BT/*.parquet' --tokenizer HuggingFaceTB/SmolLM2-360M
    python scripts/bench_data.py --tokens offline/corpus --world-size 8 --out bench_data.json

Each case builds rank 0's stream with build_train_stream (the trainer's code path: reading, the
tokenizer, packing into lanes) for the given world_size x grad_accum and times --batches micro-batches
(or --seconds, whichever ends first) after one warm-up batch. Parquet text (local files in FineWeb's
layout, or http(s):// / hf:// URLs) is read both ways, data.sharding=documents (every rank reads the
whole stream) and files (a rank reads its lanes' row groups; needs a row group per lane); a token
corpus (scripts/build_corpus.py) needs no tokenizer work. Prints a table and writes JSON.
The issue-32 target: >= 270k tokens/s per rank from parquet text, >= 5M from token shards.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from twell.data import DataConfig, build_train_stream, load_tokenizer


def bench_case(cfg: DataConfig, tokenizer, args) -> dict:
    started = time.perf_counter()
    stream = build_train_stream(
        cfg, tokenizer, args.seq_len, args.micro_batch, 0, args.world_size, args.grad_accum, seed=0
    )
    next(stream)  # opens the files, first tokenizer call
    setup_s = time.perf_counter() - started
    tokens, batches, start = 0, 0, time.perf_counter()
    while batches < args.batches and time.perf_counter() - start < args.seconds:
        batch = next(stream)
        tokens += batch["input_ids"].numel()
        batches += 1
    elapsed = time.perf_counter() - start
    row = {
        "source": cfg.source,
        "path": cfg.path,
        "sharding": cfg.sharding,
        "world_size": args.world_size,
        "grad_accum": args.grad_accum,
        "batches": batches,
        "tokens": tokens,
        "seconds": elapsed,
        "setup_s": setup_s,
        "tokens_per_s_per_rank": tokens / elapsed if elapsed > 0 else 0.0,
    }
    if hasattr(stream, "bytes_read"):
        row["bytes_read_rank0"] = stream.bytes_read
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parquet", help="parquet files (glob, folder, comma-separated, or URLs)")
    parser.add_argument("--tokens", help="token corpus folder (manifest.json + shards)")
    parser.add_argument("--tokenizer", default="offline/tokenizer", help="hub name or folder (parquet text)")
    parser.add_argument("--text-column", default="text")
    parser.add_argument("--world-size", type=int, default=1, help="ranks the data is split over")
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--batches", type=int, default=200, help="most micro-batches timed per case")
    parser.add_argument("--seconds", type=float, default=20.0, help="most seconds timed per case")
    parser.add_argument("--tokenize-batch", type=int, default=256)
    parser.add_argument("--out", default="bench_data.json")
    args = parser.parse_args(argv)
    if not (args.parquet or args.tokens):
        parser.error("give --parquet and/or --tokens")

    cases = []
    if args.parquet:
        tokenizer = load_tokenizer(args.tokenizer)
        for sharding in ("documents", "files"):
            cfg = DataConfig(
                source="local",
                path=args.parquet,
                format="parquet",
                text_column=args.text_column,
                tokenizer=args.tokenizer,
                sharding=sharding,
                tokenize_batch=args.tokenize_batch,
            )
            cases.append((cfg, tokenizer))
    if args.tokens:
        from twell.data.token_shards import read_manifest

        folder, manifest = read_manifest(args.tokens)
        tokenizer_path = folder / "tokenizer"
        cfg = DataConfig(
            source="tokens",
            path=args.tokens,
            tokenizer=str(tokenizer_path if tokenizer_path.is_dir() else args.tokenizer),
            tokenize_batch=args.tokenize_batch,
        )
        cases.append((cfg, load_tokenizer(cfg.tokenizer)))

    rows = []
    for cfg, tokenizer in cases:
        try:
            rows.append(bench_case(cfg, tokenizer, args))
        except ValueError as err:  # e.g. fewer row groups than lanes for sharding=files
            print(f"skipped {cfg.source}/{cfg.sharding}: {err}", file=sys.stderr)
            rows.append(
                {"source": cfg.source, "path": cfg.path, "sharding": cfg.sharding, "skipped": str(err)}
            )

    header = f"{'source':8} {'sharding':10} {'ranks':>5} {'tokens':>10} {'seconds':>8} {'tokens/s/rank':>14}"
    print(header)
    print("-" * len(header))
    for row in rows:
        if "skipped" in row:
            print(f"{row['source']:8} {row['sharding']:10} skipped")
            continue
        print(
            f"{row['source']:8} {row['sharding']:10} {row['world_size']:>5} {row['tokens']:>10} "
            f"{row['seconds']:>8.2f} {row['tokens_per_s_per_rank']:>14,.0f}"
        )
    Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")
    return rows


if __name__ == "__main__":
    main()
