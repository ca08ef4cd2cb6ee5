"""Robust streaming: remote reads that fail with HTTP 429 / 5xx are retried with backoff, through the
real HTTP stack (fsspec + aiohttp under HF datasets) against a local server standing in for the hub;
a persistent failure ends with a clear error naming the file."""

import pytest

from twell.data import DataConfig, build_train_stream
from twell.data.retry import RemoteReadError, is_retryable, with_retries


def served(flaky_files, write_docs, docs, shards=2):
    """docs written as parquet files into the served folder (tmp_path / "served"); their URLs."""
    write_docs(docs, shards=shards, name="served")
    return ",".join(f"{flaky_files.url}/part-{i:03d}.parquet" for i in range(shards))


def first_rows(cfg, tokenizer, n=6):
    stream = build_train_stream(cfg, tokenizer, 8, 1, rank=0, world_size=1, grad_accum=1, seed=0)
    return [next(stream)["input_ids"].tolist() for _ in range(n)]


@pytest.mark.parametrize("status", [429, 503])
def test_failed_requests_are_retried(status, flaky_files, tokenizer, make_docs, tmp_path, write_docs):
    """Fails while the files are resolved, then again in the middle of reading: same batches as local."""
    docs = make_docs(40, max_words=5)
    urls = served(flaky_files, write_docs, docs, shards=4)
    local = DataConfig(
        source="local",
        path=str(tmp_path / "served" / "part-*.parquet"),
        shuffle=False,
        sharding="files",
        shuffle_buffer=2,
        tokenize_batch=1,
    )
    remote = DataConfig(
        source="local",
        path=urls,
        shuffle=False,
        sharding="files",
        shuffle_buffer=2,
        tokenize_batch=1,
        retries=6,
        retry_backoff_s=0.01,
    )
    want = first_rows(local, tokenizer, n=30)
    flaky_files.fail(2, status)
    stream = build_train_stream(remote, tokenizer, 8, 1, rank=0, world_size=1, grad_accum=1, seed=0)
    assert flaky_files.failed == 2
    got = [next(stream)["input_ids"].tolist() for _ in range(3)]
    flaky_files.fail(2, status)
    got += [next(stream)["input_ids"].tolist() for _ in range(27)]
    assert flaky_files.failed == 2  # the second file's reads failed too, and were retried
    assert got == want


def test_persistent_failure_names_the_file(flaky_files, tokenizer, make_docs, write_docs):
    urls = served(flaky_files, write_docs, make_docs(10))
    flaky_files.fail(10**6, 503)
    cfg = DataConfig(
        source="local", path=urls, shuffle=False, sharding="files", retries=3, retry_backoff_s=0.01
    )
    with pytest.raises(RemoteReadError, match=r"failed 3 time\(s\) in a row.*data\.retries") as info:
        build_train_stream(cfg, tokenizer, 8, 1, rank=0, world_size=1, grad_accum=1, seed=0)
    assert flaky_files.url in str(info.value)


def test_missing_file_is_not_retried(flaky_files, tokenizer, make_docs, write_docs):
    urls = served(flaky_files, write_docs, make_docs(10)) + f",{flaky_files.url}/missing.parquet"
    cfg = DataConfig(
        source="local", path=urls, shuffle=False, sharding="files", retries=5, retry_backoff_s=0.01
    )
    with pytest.raises(FileNotFoundError, match="missing.parquet"):
        build_train_stream(cfg, tokenizer, 8, 1, rank=0, world_size=1, grad_accum=1, seed=0)
    assert flaky_files.requests < 10  # a 404 is not retried


def test_backoff_is_exponential_with_jitter_and_bounded():
    sleeps, calls = [], []

    class Unavailable(Exception):
        status = 503

    def flaky():
        calls.append(1)
        raise Unavailable("service unavailable")

    with pytest.raises(RemoteReadError, match="reading part-7.parquet failed 5 time"):
        with_retries(flaky, what="part-7.parquet", tries=5, backoff_s=1.0, sleep=sleeps.append)
    assert len(calls) == 5 and len(sleeps) == 4
    assert all(0 <= s <= 2**i for i, s in enumerate(sleeps))
    assert len(set(sleeps)) == 4  # jittered

    class NotFound(Exception):
        status = 404

    assert not is_retryable(NotFound()) and is_retryable(TimeoutError()) and is_retryable(Unavailable())
    assert not is_retryable(ConnectionError("Couldn't reach x on the Hub (OfflineModeIsEnabled)"))
    try:
        try:
            raise Unavailable()
        except Unavailable as err:
            raise FileNotFoundError("http://host/x.parquet") from err  # what fsspec's HTTP open does
    except FileNotFoundError as wrapped:
        assert is_retryable(wrapped)


@pytest.mark.parametrize("status", [429, 503])
def test_documents_layout_reopens_at_its_position(
    status, flaky_files, tokenizer, make_docs, tmp_path, write_docs
):
    """data.sharding=documents reads through HF datasets: a failed open of the next file in the middle
    of the stream re-opens the dataset at its last state, and the batches are the local ones."""
    docs = make_docs(40, max_words=5)
    urls = served(flaky_files, write_docs, docs, shards=2)
    common = dict(shuffle=False, shuffle_buffer=2, tokenize_batch=1, retries=6, retry_backoff_s=0.01)
    local = DataConfig(source="local", path=str(tmp_path / "served" / "part-*.parquet"), **common)
    want = first_rows(local, tokenizer, n=60)
    stream = build_train_stream(
        DataConfig(source="local", path=urls, **common),
        tokenizer,
        8,
        1,
        rank=0,
        world_size=1,
        grad_accum=1,
        seed=0,
    )
    got = [next(stream)["input_ids"].tolist() for _ in range(3)]  # the first file is open by now
    flaky_files.fail(2, status)
    got += [next(stream)["input_ids"].tolist() for _ in range(57)]
    assert flaky_files.failed == 2
    assert got == want
