"""Packing: documents joined by EOS, rows of seq_len + 1 tokens, labels shifted by one."""

import numpy as np
import pytest
import torch

from twell.data import DataConfig, build_train_stream
from twell.data.packing import LaneBuffer


def expected_tokens(docs, tokenizer):
    out = []
    for doc in docs:
        out.extend(tokenizer(doc, add_special_tokens=False)["input_ids"])
        out.append(tokenizer.eos_token_id)
    return out


def rows_of(batch):
    """The seq_len + 1 tokens of each row: inputs plus the last label."""
    return torch.cat([batch["input_ids"], batch["labels"][:, -1:]], dim=1)


def test_single_lane_is_the_documents_joined_by_eos(tokenizer, make_docs, write_docs, rng):
    docs = make_docs(30)
    cfg = DataConfig(source="local", path=write_docs(docs), shuffle=False, max_epochs=1)
    seq_len, micro_batch = rng.randint(8, 40), rng.randint(1, 4)
    stream = build_train_stream(
        cfg, tokenizer, seq_len, micro_batch, rank=0, world_size=1, grad_accum=1, seed=0
    )
    batches = list(stream)  # one epoch, then StopIteration

    want = expected_tokens(docs, tokenizer)
    rows_per_epoch = len(want) // (seq_len + 1)
    assert len(batches) == rows_per_epoch // micro_batch
    for batch in batches:
        assert batch["input_ids"].shape == batch["labels"].shape == (micro_batch, seq_len)
        assert batch["input_ids"].dtype == batch["labels"].dtype == torch.int64
        assert torch.equal(batch["labels"][:, :-1], batch["input_ids"][:, 1:])  # next-token targets
    got = torch.cat([rows_of(b) for b in batches]).flatten().tolist()
    assert got == want[: len(got)]
    # One EOS after each document whose tokens were all served (counted from the documents' lengths; a
    # share of the documents proportional to the tokens served is no bound: short documents may sit last).
    ends = np.cumsum([len(tokenizer(d, add_special_tokens=False)["input_ids"]) + 1 for d in docs])
    assert got.count(tokenizer.eos_token_id) == int((ends <= len(got)).sum())


def test_add_eos_false_joins_documents_directly(tokenizer, make_docs, write_docs):
    docs = make_docs(10)
    cfg = DataConfig(source="local", path=write_docs(docs, shards=1), shuffle=False, add_eos=False)
    stream = build_train_stream(cfg, tokenizer, 16, 1, rank=0, world_size=1, grad_accum=1, seed=0)
    got = rows_of(next(stream)).flatten().tolist()
    want = [t for doc in docs for t in tokenizer(doc, add_special_tokens=False)["input_ids"]]
    assert got == want[:17]


def test_lane_buffer_serves_tokens_in_order_across_documents(rng):
    np_rng = np.random.default_rng(rng.randrange(2**32))
    buffer = LaneBuffer(eos_id=7)
    stream, served = [], []
    for _ in range(50):
        doc = np_rng.integers(8, 100, size=int(np_rng.integers(0, 30))).tolist()
        buffer.add_document(doc)
        stream += doc + [7]
        while len(buffer) >= 11 and np_rng.random() < 0.7:
            served += buffer.take(11).tolist()
        if np_rng.random() < 0.2:  # a save/restore in between changes nothing
            restored = LaneBuffer(eos_id=7)
            restored.load_state_dict(buffer.state_dict())
            buffer = restored
    assert served == stream[: len(served)]
    assert len(buffer) == len(stream) - len(served)
    with pytest.raises(ValueError, match="holds"):
        buffer.take(len(buffer) + 1)
