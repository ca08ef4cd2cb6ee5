"""Every source gives the same batches for the same documents: parquet, jsonl, txt through HF datasets,
and a pre-tokenized shard corpus; held-out data is separate from training data."""

import pytest
import torch

from twell.data import DataConfig, build_train_stream, build_val_stream, held_out_texts


def first_batches(cfg, tokenizer, n=8, **kw):
    layout = dict(seq_len=16, micro_batch=2, rank=0, world_size=2, grad_accum=2, seed=3) | kw
    stream = build_train_stream(cfg, tokenizer, **layout)
    return [next(stream)["input_ids"] for _ in range(n)]


def flat_rows(batches):
    return (
        torch.cat([torch.cat([b["input_ids"], b["labels"][:, -1:]], 1) for b in batches]).flatten().tolist()
    )


def encode_joined(docs, tokenizer):
    return [
        t
        for d in docs
        for t in tokenizer(d, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    ]


@pytest.mark.parametrize("fmt", ["json", "text", "tokens"])
def test_formats_match_parquet(fmt, tokenizer, make_docs, write_docs, token_corpus):
    docs = make_docs(30)
    parquet = DataConfig(source="local", path=write_docs(docs, "parquet", shards=1), shuffle_buffer=5)
    if fmt == "tokens":
        other = DataConfig(source="tokens", path=token_corpus(docs, shard_tokens=10**6), shuffle_buffer=5)
    else:
        other = DataConfig(source="local", path=write_docs(docs, fmt, shards=1), shuffle_buffer=5)
    want = first_batches(parquet, tokenizer)
    got = first_batches(other, tokenizer)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_val_path_batches_repeat_and_differ_from_training(tokenizer, make_docs, write_docs):
    train_docs, val_docs = make_docs(20), make_docs(8)
    cfg = DataConfig(
        source="local",
        path=write_docs(train_docs, name="train"),
        val_path=write_docs(val_docs, name="val", shards=1),
    )
    val = build_val_stream(cfg, tokenizer, seq_len=8, micro_batch=2, rank=0, world_size=1, num_batches=5)
    first, second = list(val), list(val)
    assert len(first) == len(val) == 5
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(first, second))
    assert flat_rows(first) == encode_joined(val_docs, tokenizer)[: 5 * 2 * 9]


def test_val_docs_holds_out_the_head_of_the_stream(tokenizer, make_docs, write_docs, rng):
    docs = make_docs(30)
    held_out = rng.randint(2, 6)
    cfg = DataConfig(source="local", path=write_docs(docs), val_docs=held_out, shuffle=False)
    train = flat_rows(
        [next(build_train_stream(cfg, tokenizer, 8, 2, rank=0, world_size=1, grad_accum=1, seed=0))]
    )
    assert train == encode_joined(docs[held_out:], tokenizer)[: len(train)]
    val = flat_rows(list(build_val_stream(cfg, tokenizer, 8, 1, rank=0, world_size=1, num_batches=40)))
    head = encode_joined(docs[:held_out], tokenizer)
    assert val == (head * 40)[: len(val)]  # a small held-out set wraps around, never reaching training docs


def test_held_out_texts_are_the_validation_documents(tokenizer, make_docs, write_docs, token_corpus, rng):
    train_docs, val_docs = make_docs(20), make_docs(8)
    cfg = DataConfig(
        source="local", path=write_docs(train_docs, name="train"), val_path=write_docs(val_docs, name="val")
    )
    assert held_out_texts(cfg, tokenizer) == val_docs
    assert held_out_texts(cfg, tokenizer, max_docs=3) == val_docs[:3]
    assert held_out_texts(cfg, tokenizer, max_bytes=1) == val_docs[:1]  # always at least one
    held_out = rng.randint(2, 6)
    head = DataConfig(
        source="local", path=write_docs(train_docs, name="train"), val_docs=held_out, shuffle=False
    )
    assert held_out_texts(head, tokenizer) == train_docs[:held_out]  # never a training document
    tokens = DataConfig(source="tokens", path=token_corpus(train_docs, val_docs=val_docs), val_split="val")
    assert held_out_texts(tokens, tokenizer) == val_docs  # decoded back to the text
    with pytest.raises(ValueError, match="no held-out data"):
        held_out_texts(DataConfig(source="local", path=write_docs(train_docs, name="train")), tokenizer)
