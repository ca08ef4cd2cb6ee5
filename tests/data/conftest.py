"""Small local corpora and a tokenizer trained on them, made fresh per test session.

Files are written as parquet / jsonl / txt and read back through HF datasets, the code path users
hit with the hub. Documents are random word sequences of random lengths, so every run packs
different token streams.
"""

import json
import os
import random

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from twell.data import load_tokenizer
from twell.data.token_shards import ShardWriter, write_manifest

SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "ta", "vo", "shi", "an", "el", "or", "ix", "um", "pe", "qu"]


def random_documents(n: int, rng: random.Random, max_words: int = 60) -> list[str]:
    words = ["".join(rng.choices(SYLLABLES, k=rng.randint(1, 4))) for _ in range(300)]
    docs = []
    for _ in range(n):
        body = " ".join(rng.choices(words, k=rng.randint(1, max_words)))
        docs.append(body[0].upper() + body[1:] + rng.choice([".", "!", "?"]))
    return docs


def write_documents(
    docs: list[str], folder, fmt: str = "parquet", shards: int = 2, column: str = "text"
) -> str:
    """docs cut into `shards` contiguous files; returns a glob matching them."""
    folder.mkdir(parents=True, exist_ok=True)
    bounds = np.linspace(0, len(docs), shards + 1).astype(int)
    ext = {"parquet": "parquet", "json": "jsonl", "text": "txt"}[fmt]
    for i in range(shards):
        part = docs[bounds[i] : bounds[i + 1]]
        path = folder / f"part-{i:03d}.{ext}"
        if fmt == "parquet":
            pq.write_table(pa.table({column: part, "id": [f"doc-{j}" for j in range(len(part))]}), path)
        elif fmt == "json":
            path.write_text("".join(json.dumps({column: d, "n": len(d)}) + "\n" for d in part))
        else:
            path.write_text("\n\n".join(part))  # paragraphs: one document each
    return str(folder / f"part-*.{ext}")


def write_token_corpus(docs: list[str], tokenizer, folder, shard_tokens: int = 2000, val_docs=()) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    meta = {"vocab_size": len(tokenizer), "eos_id": tokenizer.eos_token_id}
    splits = {}
    for split, texts in (("train", docs), ("val", list(val_docs))):
        writer = ShardWriter(folder, split, shard_tokens=shard_tokens, **meta)
        for text in texts:
            writer.add(tokenizer(text, add_special_tokens=False)["input_ids"])
        writer.flush()
        splits[split] = writer.shards
    write_manifest(folder, {"tokenizer": "test", "dtype": "uint16", "splits": splits, **meta})
    return str(folder)


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(random_documents(300, random.Random(0)), trainer)
    folder = tmp_path_factory.mktemp("tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>").save_pretrained(str(folder))
    return load_tokenizer(str(folder))


@pytest.fixture
def rng(request):
    # fresh inputs every run; the seed is printed on failure, and TWELL_TEST_SEED=<seed> replays it
    seed = int(os.environ.get("TWELL_TEST_SEED") or random.SystemRandom().randrange(2**32))
    print(f"random seed {seed}")
    return random.Random(seed)


@pytest.fixture
def make_docs(rng):
    """make_docs(n) -> n fresh random documents."""
    return lambda n, max_words=60: random_documents(n, rng, max_words)


@pytest.fixture
def write_docs(tmp_path):
    """write_docs(docs, fmt="parquet", shards=2, column="text", name=fmt) -> glob of the written files."""

    def write(docs, fmt="parquet", shards=2, column="text", name=None):
        return write_documents(docs, tmp_path / (name or fmt), fmt, shards, column)

    return write


@pytest.fixture
def token_corpus(tmp_path, tokenizer):
    """token_corpus(docs, val_docs=()) -> folder of a uint16 token corpus of those documents."""
    return lambda docs, val_docs=(), shard_tokens=2000: write_token_corpus(
        docs, tokenizer, tmp_path / "tokens", shard_tokens, val_docs
    )


class FlakyFiles:
    """A local HTTP server on 127.0.0.1 standing in for the hub: serves a folder (with Range requests),
    but answers the first `fail_first` requests with `status` (429, 503, ...) or a stall (a timeout)."""

    def __init__(self, folder) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.folder = folder
        self.fail_first, self.status, self.requests, self.failed, self.bytes_served = 0, 503, 0, 0, 0
        lock, files = threading.Lock(), self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_HEAD(self):
                self.serve(body=False)

            def do_GET(self):
                self.serve(body=True)

            def serve(self, body):
                with lock:
                    files.requests += 1
                    fail = files.failed < files.fail_first
                    files.failed += fail
                if fail:
                    self.send_response(files.status)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                path = files.folder / self.path.lstrip("/")
                if not path.is_file():
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                data = path.read_bytes()
                start, end, code = 0, len(data), 200
                if "Range" in self.headers:
                    first, _, last = self.headers["Range"].removeprefix("bytes=").partition("-")
                    start, end, code = int(first), min(len(data), int(last) + 1 if last else len(data)), 206
                self.send_response(code)
                self.send_header("Accept-Ranges", "bytes")
                self.send_header("Content-Length", str(end - start))
                if code == 206:
                    self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
                self.end_headers()
                if body:
                    # counted before the write: a client that has read every byte must see them counted
                    # (counted after, a loaded machine let the test read the total before this thread
                    # added the last file's bytes, and gave them to the next rank)
                    with lock:
                        files.bytes_served += end - start
                    self.wfile.write(data[start:end])

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def fail(self, count: int, status: int = 503) -> None:
        self.fail_first, self.status, self.failed = count, status, 0


@pytest.fixture
def flaky_files(tmp_path):
    """flaky_files.url serves tmp_path / "served"; flaky_files.fail(n, status) fails the next n requests."""
    folder = tmp_path / "served"
    folder.mkdir()
    files = FlakyFiles(folder)
    yield files
    files.server.shutdown()
    files.server.server_close()
