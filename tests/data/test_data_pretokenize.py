"""scripts/pretokenize.py and the trainer reading its shards (data.source=tokens, data.sharding=files):
the shards hold exactly the tokenizer's tokens of every document in source order, for any number of
worker processes and through the hub's code path; a re-run skips what is finished and redoes what is
broken; lanes split the shards with no overlap or loss, each rank reading its share of the bytes;
resume is exact; a wrong tokenizer or a missing / corrupt shard is a clear error."""

import json
import random

import numpy as np
import pretokenize  # scripts/, on sys.path through tests/conftest.py
import pytest
from conftest import random_documents
from test_data_resume import assert_resumes_exactly
from test_data_sharding import drain, hub_folder

from twell.data import DataConfig, build_train_stream


def read_corpus(folder, split="train"):
    """Every document of a split, in manifest order, as token lists (the shards' own reader)."""
    from twell.data.token_shards import ShardDocuments, read_manifest

    folder, manifest = read_manifest(str(folder))
    docs = []
    for shard in manifest["splits"][split]:
        shard_docs = ShardDocuments(folder / shard["file"], np.dtype(manifest["dtype"]), manifest["eos_id"])
        assert len(shard_docs) == shard["documents"]
        docs += [d.tolist() for d in shard_docs]
    return docs


@pytest.fixture
def tok_dir(tokenizer, tmp_path):
    folder = tmp_path / "tok"
    tokenizer.save_pretrained(str(folder))
    return str(folder)


@pytest.fixture
def pretokenized(tmp_path, tok_dir, make_docs):
    """pretokenized(n_docs, out="shards", *flags) -> (docs, folder): FineWeb-layout parquet (4 files x 3
    row groups) tokenized in-process, one task per row group and several shards per task."""

    def build(n_docs=240, out="shards", *flags):
        docs = make_docs(n_docs, max_words=30)
        root = hub_folder(tmp_path / f"hub-{out}", docs, files=4, row_groups=3)
        folder = tmp_path / out
        pretokenize.main(
            ["--path", f"{root}/sample/10BT/*.parquet", "--tokenizer", tok_dir, "--out", str(folder)]
            + ["--workers", "1", "--task-mib", "0.000001", "--shard-tokens", "150", *flags]
        )
        return docs, str(folder)

    return build


def test_shards_hold_the_tokens_of_every_document_for_any_worker_count(
    pretokenized, tokenizer, tok_dir, tmp_path
):
    docs, folder = pretokenized()
    want = [tokenizer(d, add_special_tokens=False)["input_ids"] for d in docs]
    assert read_corpus(folder) == want
    manifest = json.loads((tmp_path / "shards" / "manifest.json").read_text())
    assert manifest["tokenizer"] == tok_dir and manifest["dtype"] == "uint16"
    assert len(manifest["source_files"]) == 4 and len(manifest["splits"]["train"]) > 12  # > 1 shard a task
    # the same files as a hub dataset, 2 worker processes: the very same shards
    pretokenize.main(
        ["--source", "hub", "--hf-name", str(tmp_path / "hub-shards"), "--hf-subset", "sample-10BT"]
        + ["--tokenizer", tok_dir, "--out", str(tmp_path / "hub"), "--workers", "2"]
        + ["--task-mib", "0.000001", "--shard-tokens", "150"]
    )
    hub = json.loads((tmp_path / "hub" / "manifest.json").read_text())
    strip = [{k: v for k, v in s.items() if k != "source"} for s in manifest["splits"]["train"]]
    assert [{k: v for k, v in s.items() if k != "source"} for s in hub["splits"]["train"]] == strip


def test_jsonl_files_a_rerun_skips_finished_tasks_and_resumes_after_a_failure(tok_dir, tmp_path, rng, capsys):
    folder, out = tmp_path / "jsonl", tmp_path / "out"
    folder.mkdir()
    parts = [random_documents(20, rng, 20) for _ in range(3)]
    for i, part in enumerate(parts):
        (folder / f"part-{i}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in part))
    broken = folder / "part-1.jsonl"
    good = broken.read_text()
    broken.write_text(good + "{not json\n")
    argv = ["--path", str(folder / "*.jsonl"), "--tokenizer", tok_dir, "--out", str(out), "--workers", "1"]
    with pytest.raises(
        SystemExit, match=r"(?s)task train-00001 \(.*part-1.jsonl\).*run the same command again to resume"
    ):
        pretokenize.main(argv + ["--shard-tokens", "100"])
    assert not (out / "manifest.json").exists() and (out / ".done" / "train-00000.json").exists()
    broken.write_text(good)  # fixed: the run resumes with the failed task
    capsys.readouterr()
    manifest = pretokenize.main(argv + ["--shard-tokens", "100"])
    assert "3 task(s), 1 already finished; 2 to run" in capsys.readouterr().out
    assert sum(s["documents"] for s in manifest["splits"]["train"]) == 60

    mtimes = {p.name: p.stat().st_mtime_ns for p in out.glob("*.bin")}
    shards = manifest["splits"]["train"]
    (out / shards[0]["file"]).unlink()  # task 0: a missing shard
    with open(out / shards[-1]["file"], "r+b") as f:  # task 2: a flipped token, same size
        f.write(bytes([f.read(1)[0] ^ 1]))
    assert pretokenize.main(argv + ["--shard-tokens", "100"]) == manifest  # sizes only: task 2 is kept
    assert "3 task(s), 2 already finished; 1 to run" in capsys.readouterr().out
    again = pretokenize.main(argv + ["--shard-tokens", "100", "--verify"])
    assert "3 task(s), 2 already finished; 1 to run" in capsys.readouterr().out and again == manifest
    task_1 = [s["file"] for s in shards if s["file"].startswith("train-00001")]
    assert all((out / f).stat().st_mtime_ns == mtimes[f] for f in task_1)  # never rewritten
    with pytest.raises(SystemExit, match=r"holds a build with other \['shard_tokens'\]"):
        pretokenize.main(argv + ["--shard-tokens", "50"])


@pytest.mark.parametrize("world_size", [2, 4])
def test_lanes_split_the_shards_and_each_rank_reads_its_share(world_size, pretokenized, tokenizer, rng):
    docs, folder = pretokenized(320)
    held_out = rng.randint(0, 30)
    cfg = DataConfig(
        source="tokens", path=folder, sharding="files", max_epochs=1, val_docs=held_out, shuffle_buffer=7
    )
    read, bytes_read = [], []
    for rank in range(world_size):
        stream = build_train_stream(
            cfg, tokenizer, 8, 1, rank=rank, world_size=world_size, grad_accum=2, seed=3
        )
        read += [tuple(d.tolist()) for d in drain(stream)]
        bytes_read.append(stream.bytes_read)
    want = [tuple(tokenizer(d, add_special_tokens=False)["input_ids"]) for d in docs[held_out:]]
    assert sorted(read) == sorted(want)  # no overlap, no loss, the head held out
    assert max(bytes_read) <= 1.1 * sum(bytes_read) / world_size, bytes_read


def test_a_corpus_of_fewer_shards_than_lanes_is_cut_into_document_ranges(pretokenized, tokenizer, rng):
    """Two large shards for 2 ranks x 4 lanes: the shards are cut into document ranges, every document is
    read exactly once per epoch (the head held out), and a resumed run continues exactly."""
    from twell.data.sharded import resolve_units, split_units

    docs, folder = pretokenized(160, "big", "--task-mib", "64", "--shard-tokens", str(10**9))
    held_out = rng.randint(0, 9)
    cfg = DataConfig(
        source="tokens", path=folder, sharding="files", max_epochs=1, val_docs=held_out, shuffle_buffer=5
    )
    units = resolve_units(cfg)
    assert len(units) < 8
    cut = split_units(units, 8)
    assert len(cut) == 8 and sum(u["rows"] - u["start"] for u in cut) == len(docs) - held_out
    assert split_units(cut, 8) == cut and split_units(units, 8) == cut  # deterministic
    read = []
    for rank in range(2):
        stream = build_train_stream(cfg, tokenizer, 8, 1, rank=rank, world_size=2, grad_accum=4, seed=5)
        read += [tuple(d.tolist()) for d in drain(stream)]
    want = [tuple(tokenizer(d, add_special_tokens=False)["input_ids"]) for d in docs[held_out:]]
    assert sorted(read) == sorted(want)
    resume_cfg = DataConfig(
        source="tokens", path=folder, sharding="files", shuffle_buffer=3, tokenize_batch=4
    )
    layout = dict(seq_len=16, micro_batch=2, world_size=2, grad_accum=4)
    epoch_tokens = sum(len(tokenizer(d)["input_ids"]) + 1 for d in docs)
    k = int(2.5 * epoch_tokens / 2 / (2 * 17)) + 1  # a rank's batches past its first epoch
    assert_resumes_exactly(resume_cfg, tokenizer, layout, 1, rng.randrange(1000), k)


def test_resume_from_shards_is_exact(pretokenized, tokenizer, rng):
    docs, folder = pretokenized(rng.randint(60, 80))
    cfg = DataConfig(
        source="tokens", path=folder, sharding="files", shuffle_buffer=rng.randint(2, 9), tokenize_batch=4
    )
    layout = dict(seq_len=rng.randint(8, 24), micro_batch=rng.randint(1, 3), world_size=2, grad_accum=2)
    epoch_tokens = sum(len(tokenizer(d)["input_ids"]) + 1 for d in docs)
    batches_per_epoch = epoch_tokens / 4 / (layout["micro_batch"] * (layout["seq_len"] + 1))
    k = int(rng.uniform(1.5, 2.5) * batches_per_epoch) + 1
    assert_resumes_exactly(cfg, tokenizer, layout, rng.randint(0, 1), rng.randrange(1000), k)


def test_wrong_tokenizer_and_missing_or_corrupt_shards_are_clear_errors(pretokenized, tokenizer, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    _, folder = pretokenized(60)
    for sharding in ("files", "documents"):
        cfg = DataConfig(source="tokens", path=folder, sharding=sharding)
        backend = Tokenizer(models.BPE())
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        alphabet = pre_tokenizers.ByteLevel.alphabet()
        trainer = trainers.BpeTrainer(
            vocab_size=450, special_tokens=["<|endoftext|>"], initial_alphabet=alphabet, show_progress=False
        )
        backend.train_from_iterator(random_documents(300, random.Random(1)), trainer)
        other = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>")
        with pytest.raises(ValueError, match=r"tokenized with .*tok \(vocabulary hash .*data.tokenizer="):
            build_train_stream(cfg, other, 8, 1, rank=0, world_size=1, grad_accum=1, seed=0)

    manifest = json.loads((tmp_path / "shards" / "manifest.json").read_text())
    first, second = (tmp_path / "shards" / s["file"] for s in manifest["splits"]["train"][:2])
    data = bytearray(first.read_bytes())
    data[0] ^= 1
    first.write_bytes(bytes(data))
    cfg = DataConfig(source="tokens", path=folder, sharding="files", shuffle=False)
    stream = build_train_stream(cfg, tokenizer, 8, 1, rank=0, world_size=1, grad_accum=1, seed=0)
    with pytest.raises(ValueError, match=f"token shard .*{first.name} is corrupt: sha256"):
        next(stream)
    second.write_bytes(second.read_bytes()[:-2])
    with pytest.raises(ValueError, match=f"shards of the wrong size: .*{second.name}"):
        build_train_stream(cfg, tokenizer, 8, 1, rank=0, world_size=1, grad_accum=1, seed=0)
    second.unlink()
    with pytest.raises(FileNotFoundError, match=f"lacks shard files .*{second.name}.*pretokenize.py"):
        build_train_stream(cfg, tokenizer, 8, 1, rank=0, world_size=1, grad_accum=1, seed=0)
