"""Bad input fails at start with a message naming the value and the fix."""

import json

import pytest

from twell.data import DataConfig, build_train_stream, build_val_stream, load_tokenizer


def build(cfg, tokenizer):
    return build_train_stream(cfg, tokenizer, 8, 1, rank=0, world_size=1, grad_accum=1, seed=0)


def test_missing_files(tokenizer, tmp_path):
    cfg = DataConfig(source="local", path=str(tmp_path / "nowhere" / "*.parquet"))
    with pytest.raises(FileNotFoundError, match=r"no files match .*nowhere.*prepare_offline_data"):
        build(cfg, tokenizer)


def test_no_text_column(tokenizer, make_docs, write_docs):
    cfg = DataConfig(source="local", path=write_docs(make_docs(5), column="body"))
    with pytest.raises(ValueError, match=r"no 'text' column \(columns: \['body', 'id'\]\).*data.text_column"):
        build(cfg, tokenizer)
    # the fix the message names works
    build(DataConfig(source="local", path=cfg.path, text_column="body"), tokenizer)


def test_text_column_that_is_not_text(tokenizer, tmp_path):
    path = tmp_path / "numbers.jsonl"
    path.write_text("".join(json.dumps({"text": i}) + "\n" for i in range(5)))
    with pytest.raises(ValueError, match="holds int, not text"):
        build(DataConfig(source="local", path=str(path)), tokenizer)


def test_unknown_extension_needs_format(tokenizer, tmp_path):
    path = tmp_path / "docs.data"
    path.write_text("hello\n")
    with pytest.raises(ValueError, match="set data.format"):
        build(DataConfig(source="local", path=str(path)), tokenizer)


def test_unknown_hub_tokenizer_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(
        ValueError, match=r"'no-such-org/no-such-tokenizer'.*HF_HUB_OFFLINE=1.*prepare_offline_data"
    ):
        load_tokenizer("no-such-org/no-such-tokenizer")


def test_missing_tokenizer_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"tokenizer folder .*missing/tok.*prepare_offline_data"):
        load_tokenizer(str(tmp_path / "missing" / "tok"))


def test_the_default_offline_tokenizer_not_built_yet_is_a_missing_folder_at_once(tmp_path, monkeypatch):
    """data.tokenizer=offline/tokenizer (the default) before prepare_offline_data.py ran, from a folder
    without offline/: no hub lookup of an "offline/tokenizer" repo (retries, then a hub error)."""
    import time

    from twell.data import tokenizer as tokenizer_module

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tokenizer_module, "resolve_path", lambda path: tmp_path / path)  # no project root
    start = time.perf_counter()
    with pytest.raises(
        FileNotFoundError, match=r"tokenizer folder 'offline/tokenizer' does not exist.*prepare_offline"
    ):
        load_tokenizer("offline/tokenizer")
    assert time.perf_counter() - start < 2


def test_tokenizer_without_eos(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]").save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="has no EOS token.*eos_token"):
        load_tokenizer(str(tmp_path))


def test_hub_dataset_offline_names_the_dataset(tokenizer, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    cfg = DataConfig(source="hub", hf_name="no-such-org/no-such-dataset", hf_subset="x")
    with pytest.raises(ValueError, match=r"no-such-org/no-such-dataset.*data=local"):
        build(cfg, tokenizer)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"source": "s3"}, "data.source='s3' is not one of"),
        ({"source": "hub"}, "needs data.hf_name"),
        ({"shuffle_buffer": 0}, "data.shuffle_buffer=0 must be >= 1"),
        ({"val_docs": -1}, "data.val_docs=-1"),
        ({"format": "csv"}, "data.format='csv'"),
    ],
)
def test_config_values(fields, message):
    with pytest.raises(ValueError, match=message):
        DataConfig(**fields)


def test_unknown_config_key():
    with pytest.raises(ValueError, match=r"unknown data config keys \['paht'\]"):
        DataConfig.from_any({"paht": "x.parquet"})


def test_no_held_out_data(tokenizer, make_docs, write_docs):
    cfg = DataConfig(source="local", path=write_docs(make_docs(5)))
    with pytest.raises(ValueError, match="no held-out data: set data.val_path"):
        build_val_stream(cfg, tokenizer, 8, 1, rank=0, world_size=1, num_batches=2)


def test_bad_layout(tokenizer, make_docs, write_docs):
    cfg = DataConfig(source="local", path=write_docs(make_docs(5)))
    with pytest.raises(ValueError, match=r"rank=2 must be in \[0, world_size=2\)"):
        build_train_stream(cfg, tokenizer, 8, 1, rank=2, world_size=2, grad_accum=1, seed=0)


def test_token_corpus_with_another_tokenizer(tokenizer, make_docs, token_corpus, tmp_path):
    folder = token_corpus(make_docs(5))
    manifest = json.loads((tmp_path / "tokens" / "manifest.json").read_text())
    manifest["eos_id"] = tokenizer.eos_token_id + 1
    (tmp_path / "tokens" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="built with EOS id .* tokenizer's EOS id is"):
        build(DataConfig(source="tokens", path=folder), tokenizer)


def test_missing_token_corpus(tokenizer, tmp_path):
    with pytest.raises(FileNotFoundError, match="no token corpus manifest.*build_corpus.py"):
        build(DataConfig(source="tokens", path=str(tmp_path / "corpus")), tokenizer)


@pytest.mark.parametrize("content", ["", "\n\n"], ids=["0 bytes", "blank lines"])
def test_empty_jsonl_names_the_file(tokenizer, tmp_path, content):
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=r"empty\.jsonl.*(is empty \(0 bytes\)|holds no documents)"):
        build(DataConfig(source="local", path=str(path)), tokenizer)


def test_missing_path_names_each_folder_once(tokenizer, tmp_path, monkeypatch):
    from twell.data.paths import PROJECT_ROOT

    monkeypatch.chdir(PROJECT_ROOT)
    with pytest.raises(FileNotFoundError, match="looked under [^ ]+\\)") as err:
        build(DataConfig(source="local", path="nowhere/*.parquet"), tokenizer)
    assert str(err.value).count(str(PROJECT_ROOT)) == 1, err.value
