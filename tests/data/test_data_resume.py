"""Exact resume: a stream restored from a saved state continues with the very batches the unbroken
stream produces, across shuffle blocks and epoch boundaries, for text and token sources."""

import io

import pytest
import torch

from twell.data import DataConfig, build_train_stream


def roundtrip(state):
    """What a checkpoint does to the state: torch.save, then a weights-only load."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def assert_same_batches(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["labels"], b["labels"])


def assert_resumes_exactly(cfg, tokenizer, layout: dict, rank: int, seed: int, k: int) -> None:
    """k batches, a state saved and serialised, k more batches (across an epoch boundary); a stream
    restored from the state gives the same k batches and epoch."""
    stream = build_train_stream(cfg, tokenizer, rank=rank, seed=seed, **layout)
    for _ in range(k):
        next(stream)
    state = roundtrip(stream.state_dict())
    want, places = [], []
    for _ in range(k):
        want.append(next(stream))
        places.append(reader_states(stream))
    assert stream.epoch >= 1, "the test should cross an epoch boundary"

    restored = build_train_stream(cfg, tokenizer, rank=rank, seed=seed, **layout)
    restored.load_state_dict(state)
    got = []
    for i in range(k):
        got.append(next(restored))
        # the readers stand where the unbroken run's did after every batch: each read is sized by the
        # mean document length seen so far, which a resumed stream once did not restore (it read in
        # other chunks and crossed epoch ends at other batches while serving the same tokens)
        assert reader_states(restored) == places[i], f"batch {i} after the resume"
    assert_same_batches(got, want)
    assert restored.epoch == stream.epoch


def reader_states(stream) -> list[dict]:
    readers = getattr(stream, "readers", None) or [stream.reader]
    return [without_read_ahead(reader.state_dict()) for reader in readers]


def without_read_ahead(state):
    """A reader state less what datasets' rebatching layer records of its inner reader's read-ahead.

    That layer resumes from its `previous_state` (and the chunks counted since), never from its inner
    `examples_iterable` entry; and after a resume the entry is stale (the inner reader's state object is
    replaced on load while the entry keeps the old one), so an exact resume may differ there only."""
    if isinstance(state, list):
        return [without_read_ahead(s) for s in state]
    if not isinstance(state, dict):
        return state
    rebatched = state.get("type") == "RebatchedArrowExamplesIterable" and state.get("previous_state")
    return {
        k: without_read_ahead(v) for k, v in state.items() if not (rebatched and k == "examples_iterable")
    }


@pytest.mark.parametrize("source", ["local", "tokens"])
def test_restored_stream_gives_the_same_next_batches(
    source, tokenizer, make_docs, write_docs, token_corpus, rng
):
    docs = make_docs(rng.randint(25, 40), max_words=20)
    path = write_docs(docs) if source == "local" else token_corpus(docs, shard_tokens=300)
    # small shuffle blocks and a short corpus, so K batches cross blocks and epochs
    cfg = DataConfig(
        source=source, path=path, shuffle=True, shuffle_buffer=rng.randint(2, 9), tokenize_batch=4
    )
    layout = dict(seq_len=rng.randint(8, 24), micro_batch=rng.randint(1, 3), world_size=2, grad_accum=2)
    rank, seed = rng.randint(0, 1), rng.randrange(1000)
    # save somewhere in the first or second epoch; the K batches after it cross an epoch boundary
    epoch_tokens = sum(len(tokenizer(d)["input_ids"]) + 1 for d in docs)
    batches_per_epoch = epoch_tokens / (layout["micro_batch"] * (layout["seq_len"] + 1)) / 2  # 2 of 4 lanes
    k = int(rng.uniform(1.2, 1.8) * batches_per_epoch) + 1

    assert_resumes_exactly(cfg, tokenizer, layout, rank, seed, k)


def test_resume_with_another_layout_is_refused(tokenizer, make_docs, write_docs):
    cfg = DataConfig(source="local", path=write_docs(make_docs(10)))
    stream = build_train_stream(cfg, tokenizer, 8, 1, rank=0, world_size=1, grad_accum=2, seed=0)
    next(stream)
    other = build_train_stream(cfg, tokenizer, 8, 1, rank=0, world_size=1, grad_accum=4, seed=0)
    with pytest.raises(ValueError, match="num_lanes: saved 2 now 4"):
        other.load_state_dict(stream.state_dict())


def test_epochs_are_counted_and_max_epochs_stops(tokenizer, make_docs, write_docs):
    docs = make_docs(6, max_words=10)
    cfg = DataConfig(source="local", path=write_docs(docs, shards=1), max_epochs=3, shuffle=False)
    stream = build_train_stream(cfg, tokenizer, 4, 1, rank=0, world_size=1, grad_accum=1, seed=0)
    rows = torch.cat([torch.cat([b["input_ids"], b["labels"][:, -1:]], 1) for b in stream]).flatten()
    per_epoch = sum(len(tokenizer(d, add_special_tokens=False)["input_ids"]) + 1 for d in docs)
    assert stream.epoch == 3
    assert len(rows) == (3 * per_epoch) // 5 * 5  # three passes over the data, cut into rows of 5
