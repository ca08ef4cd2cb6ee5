"""data.prefetch: a background thread makes the same micro-batches ahead of the loop; a state saved
with batches still queued resumes exactly under any prefetch depth; the end of the data and read
errors reach the caller in order."""

from pathlib import Path

import pytest
from test_data_resume import assert_same_batches, roundtrip

from twell.data import DataConfig, build_train_stream


@pytest.mark.parametrize("sharding", ["documents", "files"])
def test_prefetched_batches_and_resume_are_exact(sharding, tokenizer, make_docs, write_docs, rng):
    docs = make_docs(rng.randint(30, 50), max_words=20)
    path = write_docs(docs, shards=4)
    base = dict(
        source="local", path=path, sharding=sharding, shuffle_buffer=rng.randint(2, 9), tokenize_batch=3
    )
    layout = dict(
        seq_len=rng.randint(8, 24), micro_batch=rng.randint(1, 3), rank=1, world_size=2, grad_accum=2
    )
    seed = rng.randrange(1000)
    plain = build_train_stream(DataConfig(**base), tokenizer, seed=seed, **layout)
    want = [next(plain) for _ in range(40)]

    ahead = build_train_stream(DataConfig(**base, prefetch=3), tokenizer, seed=seed, **layout)
    got = [next(ahead) for _ in range(15)]
    state = roundtrip(ahead.state_dict())
    assert len(state["prefetched"]) <= 3
    got += [next(ahead) for _ in range(25)]
    assert_same_batches(got, want)
    for depth in (0, 2):  # a state saved with queued batches resumes under any depth
        restored = build_train_stream(DataConfig(**base, prefetch=depth), tokenizer, seed=seed, **layout)
        restored.load_state_dict(state)
        assert_same_batches([next(restored) for _ in range(25)], want[15:])


def test_end_of_data_and_errors_reach_the_caller(tokenizer, make_docs, write_docs):
    docs = make_docs(6, max_words=10)
    path = write_docs(docs, shards=1)
    cfg = dict(source="local", path=path, max_epochs=2, shuffle=False)
    plain = list(
        build_train_stream(DataConfig(**cfg), tokenizer, 4, 1, rank=0, world_size=1, grad_accum=1, seed=0)
    )
    ahead = build_train_stream(
        DataConfig(**cfg, prefetch=4), tokenizer, 4, 1, rank=0, world_size=1, grad_accum=1, seed=0
    )
    assert_same_batches(list(ahead), plain)
    assert ahead.epoch == 2
    with pytest.raises(StopIteration):
        next(ahead)

    # a real read error in the worker (a file gone mid-run) is raised by next(), not lost
    two = write_docs(docs, shards=2, name="two")
    cfg = DataConfig(
        source="local",
        path=two,
        sharding="files",
        shuffle=False,
        shuffle_buffer=1,
        tokenize_batch=1,
        prefetch=2,
    )
    stream = build_train_stream(cfg, tokenizer, 4, 1, rank=0, world_size=1, grad_accum=1, seed=0)
    next(stream)
    sorted(Path(two).parent.glob("*.parquet"))[1].unlink()
    with pytest.raises(FileNotFoundError):
        for _ in range(1000):
            next(stream)
