"""scripts/bench_data.py on tiny local data: FineWeb-layout parquet and pre-tokenized shards, both
sharding modes, in this process and as ranks in processes, give a row each with tokens/s per rank and
per node, and the JSON matches the table's rows. Its numbers mean nothing here."""

import json

import bench_data  # scripts/, on sys.path through tests/conftest.py
import pretokenize
from test_data_sharding import hub_folder


def test_bench_rows_for_parquet_and_token_shards(tokenizer, make_docs, tmp_path):
    docs = make_docs(200, max_words=30)
    parquet = f"{hub_folder(tmp_path / 'hub', docs, files=4, row_groups=4)}/sample/10BT/*.parquet"
    out, tok, shards = tmp_path / "bench" / "bench.json", str(tmp_path / "tok"), str(tmp_path / "shards")
    tokenizer.save_pretrained(tok)
    pretokenize.main(
        [
            "--path",
            parquet,
            "--tokenizer",
            tok,
            "--out",
            shards,
            "--workers",
            "1",
            "--task-mib",
            "1e-6",
            "--shard-tokens",
            "200",
        ]
    )
    layout = ["--seq-len", "16", "--micro-batch", "2", "--batches", "5", "--grad-accum", "2"]
    rows = bench_data.main(
        ["--parquet", parquet, "--tokens", shards, "--tokenizer", tok, "--world-size", "2", "--out", str(out)]
        + layout
    )
    assert [(r["source"], r["sharding"]) for r in rows] == [
        ("local", "documents"),
        ("local", "files"),
        ("tokens", "documents"),
        ("tokens", "files"),
    ]
    for row in rows:
        assert (row["procs"], row["workers"], row["batches"], row["tokens"]) == (1, None, 5, 5 * 2 * 16)
        assert row["tokens_per_s_per_rank"] > 0
    assert rows[1]["bytes_read_per_rank"][0] > 0 and rows[3]["bytes_read_per_rank"][0] > 0
    assert json.loads(out.read_text())["rows"] == rows

    # two ranks as processes, timed together: per node is both ranks' tokens over the slower one's time
    rows = bench_data.main(
        ["--tokens", shards, "--procs", "2", "--workers", "1,2", "--out", str(out)] + layout
    )
    assert [(r["sharding"], r["procs"], r["world_size"], r["workers"]) for r in rows] == [
        ("documents", 2, 2, 1),
        ("files", 2, 2, 1),
    ]
    for row in rows:
        assert [r["rank"] for r in row["ranks"]] == [0, 1] and row["tokens"] == 2 * 5 * 2 * 16
        assert row["tokens_per_s_per_node"] == row["tokens"] / max(r["seconds"] for r in row["ranks"])
    files = rows[1]["bytes_read_per_rank"]
    assert max(files) <= 1.1 * sum(files) / 2, files
