"""Resuming on another number of processes: the states every rank saved at the end of an optimizer
step, dealt out to another (world_size, grad_accum) with the same lane count, continue with exactly the
global batches of the unbroken run (across shuffle blocks and an epoch boundary, with batches made
ahead by the prefetcher); another lane count, or a state saved within a step, is refused."""

import pytest
import torch
from test_data_lanes import global_batches
from test_data_resume import roundtrip

from twell.data import DataConfig, build_train_stream
from twell.data.stream import SAVED_RANKS


def build_ranks(cfg, tokenizer, world_size, grad_accum, **kw):
    return [
        build_train_stream(cfg, tokenizer, rank=r, world_size=world_size, grad_accum=grad_accum, **kw)
        for r in range(world_size)
    ]


def run_steps(streams, grad_accum, steps):
    return [
        torch.cat([next(s)["input_ids"] for s in streams for _ in range(grad_accum)]) for _ in range(steps)
    ]


@pytest.mark.parametrize("sharding", ["documents", "files"])
@pytest.mark.parametrize(
    "saved, resumed", [((2, 2), (4, 1)), ((2, 2), (1, 4)), ((4, 1), (2, 2)), ((1, 4), (4, 1))]
)
def test_resume_on_another_split_continues_the_same_batches(
    sharding, saved, resumed, tokenizer, make_docs, write_docs, rng
):
    docs = make_docs(rng.randint(20, 30), max_words=20)
    base = dict(
        source="local", path=write_docs(docs, shards=4), sharding=sharding, shuffle_buffer=rng.randint(2, 9),
        tokenize_batch=rng.randint(1, 5),
    )  # fmt: skip
    kw = dict(seq_len=rng.randint(8, 24), micro_batch=rng.randint(1, 3), seed=rng.randrange(1000))
    step_tokens = 4 * kw["micro_batch"] * (kw["seq_len"] + 1)
    epoch_tokens = sum(len(tokenizer(d)["input_ids"]) + 1 for d in docs)
    before = rng.randint(1, max(1, epoch_tokens // step_tokens // 2))
    # past the end of an epoch on every lane (documents are dealt to lanes unevenly: twice the mean)
    after = 2 * (epoch_tokens // step_tokens) + 4
    reference = global_batches(DataConfig(**base), tokenizer, *saved, before + after, **kw)

    # the saving run makes batches ahead on threads; the resumed run under another depth
    streams = build_ranks(DataConfig(**base, prefetch=rng.randint(0, 3)), tokenizer, *saved, **kw)
    saved_run = run_steps(streams, saved[1], before)
    assert all(torch.equal(a, b) for a, b in zip(saved_run, reference[:before], strict=True))
    states = [roundtrip(s.state_dict()) for s in streams]
    continued = build_ranks(DataConfig(**base, prefetch=rng.randint(0, 2)), tokenizer, *resumed, **kw)
    for stream in continued:
        stream.load_state_dict({SAVED_RANKS: states})
    got = run_steps(continued, resumed[1], after)
    assert all(torch.equal(a, b) for a, b in zip(got, reference[before:], strict=True))
    assert min(stream.epoch for stream in continued) >= 1, "the test should cross an epoch boundary"


@pytest.mark.parametrize("sharding", ["documents", "files"])
def test_another_lane_count_or_a_state_within_a_step_is_refused(sharding, tokenizer, make_docs, write_docs):
    cfg = DataConfig(source="local", path=write_docs(make_docs(30), shards=4), sharding=sharding)
    streams = build_ranks(cfg, tokenizer, 2, 2, seq_len=8, micro_batch=1, seed=0)
    run_steps(streams, 2, 2)
    states = [roundtrip(s.state_dict()) for s in streams]
    fewer_lanes = build_train_stream(cfg, tokenizer, 8, 1, rank=0, world_size=1, grad_accum=2, seed=0)
    with pytest.raises(
        ValueError, match=r"num_lanes: saved 4 now 2.*same 4 lanes, so keep global_batch_tokens"
    ):
        fewer_lanes.load_state_dict({SAVED_RANKS: states})

    next(streams[1])  # rank 1 one micro-batch into the next step
    states[1] = roundtrip(streams[1].state_dict())
    other_split = build_train_stream(cfg, tokenizer, 8, 1, rank=0, world_size=4, grad_accum=1, seed=0)
    with pytest.raises(
        ValueError, match="rank 1 was saved at micro-step 1 of 2, not at the end of an optimizer"
    ):
        other_split.load_state_dict({SAVED_RANKS: states})
