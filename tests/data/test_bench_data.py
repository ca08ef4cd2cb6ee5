"""scripts/bench_data.py on tiny local data: FineWeb-layout parquet (both sharding modes) and a token
corpus give a row each with tokens/s, and the JSON matches the table's rows. Its numbers mean nothing here."""

import json

import bench_data  # scripts/, on sys.path through tests/conftest.py
from test_data_sharding import hub_folder


def test_bench_rows_for_parquet_and_token_shards(tokenizer, make_docs, token_corpus, tmp_path):
    docs = make_docs(200, max_words=30)
    folder = hub_folder(tmp_path / "hub", docs, files=4, row_groups=4)
    out = tmp_path / "bench.json"
    tokenizer.save_pretrained(str(tmp_path / "tok"))
    rows = bench_data.main(
        ["--parquet", f"{folder}/sample/10BT/*.parquet", "--tokens", token_corpus(docs)]
        + ["--tokenizer", str(tmp_path / "tok"), "--world-size", "2", "--grad-accum", "2"]
        + ["--seq-len", "16", "--micro-batch", "2", "--batches", "5", "--out", str(out)]
    )
    assert [(r["source"], r["sharding"]) for r in rows] == [
        ("local", "documents"),
        ("local", "files"),
        ("tokens", "documents"),
    ]
    for row in rows:
        assert row["batches"] == 5 and row["tokens"] == 5 * 2 * 16 and row["tokens_per_s_per_rank"] > 0
    assert rows[1]["bytes_read_rank0"] > 0
    assert json.loads(out.read_text())["rows"] == rows
