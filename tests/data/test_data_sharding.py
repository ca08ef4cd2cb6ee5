"""data.sharding=files: the files are split over the lanes, so each rank reads only its share of the
bytes, with no document read twice or lost; the global batch still depends only on the lane count,
and a restored stream continues exactly."""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from test_data_lanes import global_batches
from test_data_resume import assert_resumes_exactly

from twell.data import DataConfig, build_train_stream


def hub_folder(root, docs, files=6, row_groups=8):
    """A folder laid out like HuggingFaceFW/fineweb's repository: README configs, sample/10BT/*.parquet
    in FineWeb's schema, several row groups per file. Read with source=hub, hf_name=<folder>."""
    data = root / "sample" / "10BT"
    data.mkdir(parents=True)
    per_file = -(-len(docs) // files)
    for i in range(files):
        part = docs[i * per_file : (i + 1) * per_file]
        table = pa.table(
            {
                "text": part,
                "id": [f"<urn:uuid:{i}-{j}>" for j in range(len(part))],
                "dump": ["CC-MAIN-2024-10"] * len(part),
                "url": [f"https://example.org/{i}/{j}" for j in range(len(part))],
                "date": ["2024-02-20T00:00:00Z"] * len(part),
                "file_path": [f"s3://commoncrawl/{i}.warc.gz"] * len(part),
                "language": ["en"] * len(part),
                "language_score": [0.9] * len(part),
                "token_count": [len(d.split()) for d in part],
            }
        )
        pq.write_table(table, data / f"{i:03d}_00000.parquet", row_group_size=-(-len(part) // row_groups))
    (root / "README.md").write_text(
        "---\nconfigs:\n- config_name: sample-10BT\n  data_files:\n  - split: train\n    path: sample/10BT/*\n---\n"
    )
    return str(root)


def hub_cfg(folder, **kw):
    return DataConfig(source="hub", hf_name=folder, hf_subset="sample-10BT", path="", sharding="files", **kw)


def drain(stream):
    """Every document each of the stream's lanes reads in one epoch (its real reader, max_epochs=1)."""
    docs = []
    for reader in stream.readers:
        while True:
            try:
                docs.append(reader.next_document()[1])
            except StopIteration:
                break
    return docs


@pytest.mark.parametrize("world_size", [2, 4])
def test_ranks_partition_the_stream(world_size, tokenizer, make_docs, tmp_path, rng):
    docs = make_docs(480, max_words=30)
    held_out = rng.randint(0, 30)
    cfg = hub_cfg(hub_folder(tmp_path / "hub", docs), max_epochs=1, val_docs=held_out, shuffle_buffer=7)
    read, bytes_read, rows_read = [], [], []
    for rank in range(world_size):
        stream = build_train_stream(
            cfg, tokenizer, 8, 1, rank=rank, world_size=world_size, grad_accum=2, seed=1
        )
        read.append(drain(stream))
        bytes_read.append(stream.bytes_read)
        rows_read.append(stream.rows_read)
    everything = [d for rank_docs in read for d in rank_docs]
    assert sorted(everything) == sorted(docs[held_out:])  # no overlap, no loss, the head held out
    total = sum(bytes_read)
    assert max(bytes_read) <= 1.1 * total / world_size, bytes_read
    assert max(rows_read) <= 1.1 * (len(docs) + world_size) / world_size, rows_read


@pytest.mark.parametrize("world_size", [2, 4])
def test_bytes_fetched_per_rank_over_http(world_size, flaky_files, tokenizer, make_docs, write_docs):
    """The bytes a local HTTP server (standing in for the hub) sends each rank for one epoch of its
    lanes: about 1/world_size of the files, each file sent to one rank only."""
    docs = make_docs(1600, max_words=30)  # 200 documents a file: file sizes within a few percent
    write_docs(docs, shards=8, name="served")  # the folder flaky_files serves
    urls = ",".join(f"{flaky_files.url}/part-{i:03d}.parquet" for i in range(8))
    cfg = DataConfig(source="local", path=urls, sharding="files", max_epochs=1)
    served = []
    for rank in range(world_size):
        stream = build_train_stream(
            cfg, tokenizer, 8, 1, rank=rank, world_size=world_size, grad_accum=2, seed=0
        )
        before = flaky_files.bytes_served  # resolving the files read their footers: not the data
        drain(stream)
        served.append(flaky_files.bytes_served - before)
    total = sum(f.stat().st_size for f in flaky_files.folder.glob("*.parquet"))
    assert 0.95 * total <= sum(served) <= 1.05 * total, (served, total)  # every file fetched once
    assert 0.9 * total / world_size <= min(served) <= max(served) <= 1.1 * total / world_size, (served, total)


@pytest.mark.parametrize("layouts", [[(1, 4), (2, 2), (4, 1)]])
def test_global_batches_equal_for_equal_lane_counts(layouts, tokenizer, make_docs, tmp_path, rng):
    cfg = hub_cfg(hub_folder(tmp_path / "hub", make_docs(120), files=3, row_groups=4), shuffle_buffer=5)
    kw = dict(seq_len=rng.randint(8, 32), micro_batch=rng.randint(1, 3), seed=rng.randrange(1000))
    reference = global_batches(cfg, tokenizer, *layouts[0], 12, **kw)
    for world_size, grad_accum in layouts[1:]:
        other = global_batches(cfg, tokenizer, world_size, grad_accum, 12, **kw)
        assert all(torch.equal(a, b) for a, b in zip(reference, other)), (world_size, grad_accum)


def test_restored_stream_gives_the_same_next_batches(tokenizer, make_docs, write_docs, rng):
    docs = make_docs(rng.randint(40, 60), max_words=20)
    path = write_docs(docs, shards=4)
    cfg = DataConfig(
        source="local", path=path, sharding="files", shuffle_buffer=rng.randint(2, 9), tokenize_batch=4
    )
    layout = dict(seq_len=rng.randint(8, 24), micro_batch=rng.randint(1, 3), world_size=2, grad_accum=2)
    rank, seed = rng.randint(0, 1), rng.randrange(1000)
    epoch_tokens = sum(len(tokenizer(d)["input_ids"]) + 1 for d in docs)
    # 2 of 4 lanes; a lane holds one file here, about a quarter of the tokens
    batches_per_epoch = epoch_tokens / 4 / (layout["micro_batch"] * (layout["seq_len"] + 1))
    k = int(rng.uniform(1.5, 2.5) * batches_per_epoch) + 1

    assert_resumes_exactly(cfg, tokenizer, layout, rank, seed, k)


def test_changed_files_or_layout_refuse_the_saved_state(tokenizer, make_docs, write_docs, tmp_path):
    docs = make_docs(40)
    cfg = DataConfig(source="local", path=write_docs(docs, shards=4), sharding="files")
    stream = build_train_stream(cfg, tokenizer, 8, 1, rank=0, world_size=1, grad_accum=2, seed=0)
    next(stream)
    state = stream.state_dict()
    fewer = DataConfig(source="local", path=write_docs(docs[:30], shards=4, name="fewer"), sharding="files")
    other = build_train_stream(fewer, tokenizer, 8, 1, rank=0, world_size=1, grad_accum=2, seed=0)
    with pytest.raises(ValueError, match="units: saved"):
        other.load_state_dict(state)
    documents = build_train_stream(
        DataConfig(source="local", path=cfg.path), tokenizer, 8, 1, rank=0, world_size=1, grad_accum=2, seed=0
    )
    with pytest.raises(ValueError, match="sharding: saved 'files' now None"):
        documents.load_state_dict(state)


def test_too_few_row_groups_for_the_lanes_is_a_clear_error(tokenizer, make_docs, write_docs):
    cfg = DataConfig(source="local", path=write_docs(make_docs(10), shards=2), sharding="files")
    with pytest.raises(ValueError, match=r"2 row group\(s\) for 4 lanes.*data.sharding=documents"):
        build_train_stream(cfg, tokenizer, 8, 1, rank=0, world_size=2, grad_accum=2, seed=0)
    other = DataConfig(
        source="local", path=write_docs(make_docs(10), column="body", name="body"), sharding="files"
    )
    with pytest.raises(
        ValueError, match=r"part-000.parquet has no 'text' column \(columns: \['body', 'id'\]\)"
    ):
        build_train_stream(other, tokenizer, 8, 1, rank=0, world_size=1, grad_accum=1, seed=0)
    jsonl = DataConfig(source="local", path=write_docs(make_docs(10), "json"), sharding="files")
    with pytest.raises(ValueError, match="reads parquet row groups.*data.sharding=documents"):
        build_train_stream(jsonl, tokenizer, 8, 1, rank=0, world_size=1, grad_accum=1, seed=0)


def _resolve_on_rank(rank, world_size, init_file, folder, out):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        from twell.data.sharded import resolve_units_once

        # only rank 0 sees the data: the others must get the unit list from its broadcast
        path = folder if rank == 0 else "/nonexistent/twell/*.parquet"
        try:
            units = resolve_units_once(DataConfig(source="local", path=path, sharding="files"), world_size)
            result = {"units": units}
        except ValueError as err:
            result = {"error": str(err)}
        torch.save(result, f"{out}/{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("ok", [True, False])
def test_rank_0_resolves_the_files_once_and_broadcasts(ok, make_docs, write_docs, tmp_path):
    import torch.multiprocessing as mp

    folder = write_docs(make_docs(20), shards=3) if ok else str(tmp_path / "missing" / "*.parquet")
    mp.spawn(_resolve_on_rank, args=(2, tmp_path / "init", folder, tmp_path), nprocs=2, join=True)
    results = [torch.load(tmp_path / f"{rank}.pt") for rank in range(2)]
    if ok:
        assert results[0] == results[1] and len(results[0]["units"]) == 3
    else:
        assert all("rank 0 could not resolve the data files" in r["error"] for r in results)
        assert all("missing" in r["error"] for r in results)
