"""Build the offline default data: real English text from Python's bundled documentation, in FineWeb's
parquet schema, and a small byte-level BPE tokenizer trained on it.

    python scripts/prepare_offline_data.py            # writes offline/sample/ and offline/tokenizer/
    python scripts/prepare_offline_data.py --force    # rebuild even if up to date

Documents: every pydoc topic (``pydoc_data.topics``: the language reference sections that ``help()``
shows) and, per standard-library module, its docstrings (module, classes, functions) read from the
source with ``ast`` (nothing is imported, so no module side effects). Deterministic for a given Python
version. About 5% of documents (by a hash of their id) go to the validation file.
"""

from __future__ import annotations

import argparse
import ast
import datetime as dt
import json
import platform
import re
import shutil
import sys
import sysconfig
import uuid
import zlib
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from twell.data.tokenizer import train_bpe_tokenizer

ROOT = Path(__file__).resolve().parents[1]

VERSION = 2  # bump when the output changes, so existing copies are rebuilt
EOS = "<|endoftext|>"
MIN_CHARS = 300
DOC_CHARS = 2000
SKIP_DIRS = {
    "site-packages",
    "dist-packages",
    "test",
    "tests",
    "idlelib",
    "turtledemo",
    "__pycache__",
    "lib2to3",
}
SCHEMA = pa.schema(
    [
        ("text", pa.string()),
        ("id", pa.string()),
        ("dump", pa.string()),
        ("url", pa.string()),
        ("date", pa.string()),
        ("file_path", pa.string()),
        ("language", pa.string()),
        ("language_score", pa.float64()),
        ("token_count", pa.int64()),
    ]
)


def topic_documents() -> list[tuple[str, str]]:
    """(url, text) of each pydoc topic."""
    import pydoc_data.topics as topics

    source = Path(topics.__file__).resolve()
    return [(f"file://{source}#{name}", text) for name, text in sorted(topics.topics.items())]


def module_documents(stdlib: Path) -> list[tuple[str, str]]:
    """(url, text) per standard-library module: its docstrings in source order, each under its name."""
    docs = []
    for path in sorted(stdlib.rglob("*.py")):
        if SKIP_DIRS & set(path.relative_to(stdlib).parts[:-1]) or path.name.startswith("test_"):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue  # a few stdlib files are deliberately broken (bad-syntax fixtures)
        module = ".".join(path.relative_to(stdlib).with_suffix("").parts).removesuffix(".__init__")
        # Consecutive docstrings are grouped into documents of about DOC_CHARS characters, so a big
        # module gives several web-page-sized documents rather than one huge one.
        group: list[str] = []
        for name, docstring in _documented(tree, prefix=module):
            group.append(f"{name}\n\n{docstring}")
            if sum(map(len, group)) >= DOC_CHARS:
                docs.append((f"file://{path}#{group[0].split(chr(10))[0]}", "\n\n".join(group)))
                group = []
        if group and sum(map(len, group)) >= MIN_CHARS:
            docs.append((f"file://{path}#{group[0].split(chr(10))[0]}", "\n\n".join(group)))
    return docs


def _documented(tree: ast.AST, prefix: str):
    """(qualified name, docstring) of the node and its classes/functions, depth first, in source order."""
    docstring = ast.get_docstring(tree)
    if docstring:
        yield prefix, docstring
    for child in getattr(tree, "body", []):
        if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            yield from _documented(child, f"{prefix}.{child.name}")


def language_score(text: str) -> float:
    # FineWeb's score is fastText's confidence that the text is English; we have no such model
    # offline, so use the share of word-like tokens that are plain ASCII words (docstrings are English).
    tokens = text.split()
    words = sum(1 for t in tokens if re.fullmatch(r"[A-Za-z][a-z]*[.,;:]?", t))
    return round(words / max(1, len(tokens)), 4)


def build_rows(docs: list[tuple[str, str]]) -> list[dict]:
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    build_date = dt.datetime.strptime(" ".join(platform.python_build()[1].split()[:3]), "%b %d %Y")
    rows = []
    for url, text in docs:
        rows.append(
            {
                "text": text,
                "id": f"<urn:uuid:{uuid.uuid5(uuid.NAMESPACE_URL, url)}>",
                "dump": f"python-{version}-docs",
                "url": url,
                "date": build_date.strftime("%Y-%m-%dT00:00:00Z"),
                "file_path": url.removeprefix("file://").split("#")[0],
                "language": "en",
                "language_score": language_score(text),
                "token_count": 0,  # filled in after the tokenizer is trained
            }
        )
    return rows


def write_parquet(rows: list[dict], path: Path) -> None:
    pq.write_table(pa.Table.from_pylist(rows, schema=SCHEMA), path, row_group_size=256)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", default=str(ROOT / "offline"), help="output folder (default: <project>/offline)"
    )
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--val-every", type=int, default=20, help="about 1 in N documents is held out")
    parser.add_argument("--train-shards", type=int, default=2)
    parser.add_argument("--force", action="store_true", help="rebuild even if the output is up to date")
    args = parser.parse_args()

    out = Path(args.out)
    stamp_path = out / "prepare_stamp.json"
    stamp = {
        "version": VERSION,
        "python": platform.python_version(),
        "vocab_size": args.vocab_size,
        "val_every": args.val_every,
        "train_shards": args.train_shards,
    }
    if not args.force and stamp_path.is_file() and json.loads(stamp_path.read_text()) == stamp:
        print(f"offline data up to date in {out} (use --force to rebuild):")
        for path in sorted((out / "sample").iterdir()) + [out / "tokenizer"]:
            print(f"  {path}")
        return

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    rows = build_rows(topic_documents() + module_documents(stdlib))
    val = [r for r in rows if zlib.crc32(r["id"].encode()) % args.val_every == 0]
    train = [r for r in rows if zlib.crc32(r["id"].encode()) % args.val_every != 0]

    # Build in a temporary folder and swap it in, so an interrupted run never leaves half an output.
    tmp = out / ".prepare_tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "sample").mkdir(parents=True)
    tokenizer = train_bpe_tokenizer([r["text"] for r in train], args.vocab_size, tmp / "tokenizer", EOS)
    tokenizer = tokenizer.backend_tokenizer  # the Rust tokenizer: encode_batch gives .ids directly
    for split in (train, val):
        for row, encoding in zip(
            split, tokenizer.encode_batch([r["text"] for r in split], add_special_tokens=False)
        ):
            row["token_count"] = len(encoding.ids)
    shards = max(1, args.train_shards)
    for i in range(shards):
        write_parquet(train[i::shards], tmp / "sample" / f"train-{i:05d}.parquet")
    write_parquet(val, tmp / "sample" / "val-00000.parquet")

    for name in ("sample", "tokenizer"):
        shutil.rmtree(out / name, ignore_errors=True)
        (tmp / name).rename(out / name)
    tmp.rmdir()
    stamp_path.write_text(json.dumps(stamp) + "\n")

    for name, split in (("train", train), ("val", val)):
        chars = sum(len(r["text"]) for r in split)
        tokens = sum(r["token_count"] for r in split)
        print(f"{name}: {len(split)} documents, {chars / 1e6:.2f} M characters, {tokens / 1e6:.2f} M tokens")
    for path in sorted((out / "sample").iterdir()):
        print(f"wrote {path} ({path.stat().st_size / 1e6:.2f} MB)")
    print(f"wrote {out / 'tokenizer'} (byte-level BPE, vocab {tokenizer.get_vocab_size()}, EOS {EOS!r})")


if __name__ == "__main__":
    main()
