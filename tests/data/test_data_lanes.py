"""The lanes layout: the global batch of every optimizer step depends only on world_size * grad_accum,
so one process with gradient accumulation sees what several data-parallel processes see."""

import pytest
import torch

from twell.data import DataConfig, build_train_stream


def global_batches(cfg, tokenizer, world_size, grad_accum, steps, **kw):
    """Per optimizer step: all micro-batches of all ranks, in lane order (rank-major, micro-step minor)."""
    streams = [
        build_train_stream(cfg, tokenizer, rank=r, world_size=world_size, grad_accum=grad_accum, **kw)
        for r in range(world_size)
    ]
    steps_out = []
    for _ in range(steps):
        micro = [next(s)["input_ids"] for s in streams for _ in range(grad_accum)]
        steps_out.append(torch.cat(micro))
    return steps_out


@pytest.mark.parametrize("layouts", [[(1, 2), (2, 1)], [(1, 4), (2, 2), (4, 1)]])
def test_global_batches_equal_for_equal_lane_counts(layouts, tokenizer, make_docs, write_docs, rng):
    cfg = DataConfig(
        source="local", path=write_docs(make_docs(rng.randint(30, 50))), shuffle_buffer=rng.randint(3, 20)
    )
    kw = dict(seq_len=rng.randint(8, 32), micro_batch=rng.randint(1, 3), seed=rng.randrange(1000))
    steps = 12
    reference = global_batches(cfg, tokenizer, *layouts[0], steps, **kw)
    for world_size, grad_accum in layouts[1:]:
        other = global_batches(cfg, tokenizer, world_size, grad_accum, steps, **kw)
        assert all(torch.equal(a, b) for a, b in zip(reference, other)), (
            layouts[0],
            (world_size, grad_accum),
        )


def test_lanes_split_the_documents_between_ranks(tokenizer, make_docs, write_docs):
    """Without shuffling, lane l holds documents l, l + N, l + 2N, ... joined by EOS."""
    docs = make_docs(12)
    cfg = DataConfig(source="local", path=write_docs(docs), shuffle=False)
    for rank in range(2):
        stream = build_train_stream(cfg, tokenizer, 4, 1, rank=rank, world_size=2, grad_accum=1, seed=0)
        rows = [next(stream) for _ in range(6)]
        got = (
            torch.cat([torch.cat([b["input_ids"], b["labels"][:, -1:]], 1) for b in rows]).flatten().tolist()
        )
        want = []
        for doc in docs[rank::2]:
            want += tokenizer(doc, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        assert got == want[: len(got)]
