"""scripts/build_corpus.py's text extraction: dictd databases and POD pages become clean prose."""

import gzip
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def build_corpus():
    spec = importlib.util.spec_from_file_location("build_corpus", ROOT / "scripts" / "build_corpus.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def b64(number: int) -> str:
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    out = ""
    while True:
        out = alphabet[number % 64] + out
        number //= 64
        if not number:
            return out


def test_dictd_entries_are_sliced_by_index_and_cleaned(build_corpus, tmp_path, monkeypatch, make_docs):
    bodies = make_docs(5)
    entries = [
        f'Word{i} \\W*ord"\\, n.\n   1. {body}\n      [1913 Webster]\n' for i, body in enumerate(bodies)
    ]
    blob = "".join(entries).encode()
    index, offset = [], 0
    for i, entry in enumerate(entries):
        size = len(entry.encode())
        index.append(f"word{i}\t{b64(offset)}\t{b64(size)}")
        index.append(f"alias{i}\t{b64(offset)}\t{b64(size)}")  # two headwords, one entry: read once
        offset += size
    (tmp_path / "test.index").write_text("\n".join(index) + "\n")
    with gzip.open(tmp_path / "test.dict.dz", "wb") as f:
        f.write(blob)
    monkeypatch.setattr(build_corpus, "DICTD", tmp_path)

    got = build_corpus.dictd_entries("test")
    # Entries that clean down to under 20 characters carry no prose and are dropped by design; the
    # random bodies can be that short.
    want = [f"Word{i} , n. 1. {body}" for i, body in enumerate(bodies)]
    assert got == [text for text in want if len(text) >= 20]


def test_pod_keeps_prose_and_drops_code(build_corpus, tmp_path):
    pod = tmp_path / "x.pod"
    pod.write_text(
        "=head1 NAME\n\nperlthing - how the thing works in practice\n\n"
        "    my $x = 1;  # code is dropped\n\n"
        "The C<thing> function returns B<every> value that L<perlfunc/sort> would give you,\n"
        "in the same order.\n"
    )
    got = build_corpus.pod_paragraphs(str(pod))
    assert got == [
        "perlthing - how the thing works in practice",
        "The thing function returns every value that perlfunc/sort would give you, in the same order.",
    ]


def test_group_reaches_the_target_size(build_corpus, make_docs):
    pieces = make_docs(50)
    docs = build_corpus.group(pieces, 500)
    assert "\n\n".join(docs) == "\n\n".join(pieces)
    assert all(len(d) >= 500 for d in docs[:-1])
