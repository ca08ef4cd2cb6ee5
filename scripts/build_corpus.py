"""Build a tokenized corpus of real English text from Debian packages, for training without internet.

    python scripts/build_corpus.py --install        # apt-get the text packages first (root)
    python scripts/build_corpus.py                   # -> offline/corpus/ (uint16 shards + manifest.json)
    python train.py data=corpus ...                  # stream it (data.source=tokens)

Text (all English prose, cleaned of markup and re-flowed into paragraphs):
  dict-gcide   GCIDE: Webster's 1913 dictionary and additions, definitions with literary quotations
  dict-wn      WordNet glosses and usage examples
  dict-foldoc, dict-jargon, dict-devil   computing dictionary, Jargon File, The Devil's Dictionary
  perl-doc     the Perl manual pages (prose paragraphs only)
  git-doc      Git's manuals and guides (prose paragraphs only)
  debian-reference-en, fortunes          the Debian Reference; quotations
Consecutive entries are grouped into documents of about --doc-chars characters, the documents are
shuffled (fixed seed) and about --val-fraction of them held out. By default a byte-level BPE with
--vocab-size tokens (16,384) is trained on the training documents and saved in the corpus folder
(offline/corpus/tokenizer), so the folder is self-contained; --tokenizer uses an existing one instead.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import random
import re
import shutil
import subprocess
import sys
import time
import zlib
from pathlib import Path

from twell.data.token_shards import ShardWriter, token_dtype, write_manifest
from twell.data.tokenizer import train_bpe_tokenizer

ROOT = Path(__file__).resolve().parents[1]

PACKAGES = ["dict-gcide", "dict-wn", "dict-foldoc", "dict-jargon", "dict-devil", "perl-doc", "git-doc",
            "debian-reference-en", "fortunes"]  # fmt: skip
DICTD = Path("/usr/share/dictd")
EOS = "<|endoftext|>"
_B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"


# ---------------------------------------------------------------- text cleaning helpers
def reflow(paragraph: str) -> str:
    """A hard-wrapped, indented paragraph as one line of text."""
    return " ".join(paragraph.split())


def paragraphs(text: str) -> list[str]:
    return [p for p in re.split(r"\n\s*\n", text) if p.strip()]


def is_prose(paragraph: str) -> bool:
    # Drops code, tables and option lists: prose is mostly letters and spaces.
    flat = reflow(paragraph)
    letters = sum(c.isalpha() or c == " " for c in flat)
    return len(flat) >= 40 and letters >= 0.85 * len(flat) and flat.count(" ") >= 6


def group(pieces: list[str], doc_chars: int) -> list[str]:
    """Consecutive pieces joined (blank line between) into documents of at least doc_chars characters."""
    docs, current, size = [], [], 0
    for piece in pieces:
        current.append(piece)
        size += len(piece)
        if size >= doc_chars:
            docs.append("\n\n".join(current))
            current, size = [], 0
    if current:
        docs.append("\n\n".join(current))
    return docs


# ---------------------------------------------------------------- sources
def dictd_entries(name: str) -> list[str]:
    """Entries of a dictd database, in order, with dictionary markup removed."""
    index, data = DICTD / f"{name}.index", DICTD / f"{name}.dict.dz"
    if not data.is_file():
        return []
    raw = gzip.open(data).read()
    spans = set()
    for line in index.read_text(encoding="utf-8", errors="replace").splitlines():
        parts = line.split("\t")
        if len(parts) >= 3 and not parts[0].startswith("00"):  # 00-database-* are metadata entries
            spans.add((_b64(parts[1]), _b64(parts[2])))
    entries = []
    for offset, length in sorted(spans):
        text = raw[offset : offset + length].decode("utf-8", errors="replace")
        text = re.sub(r"^\s*\[[^\]\n]{1,40}\]\s*$", "", text, flags=re.M)  # source tags: [1913 Webster]
        text = re.sub(r"\[(syn|ant|also|see also):[^\]]*\]", "", text)  # WordNet word lists
        text = re.sub(r"\\[^\\\n]{0,60}\\", "", text)  # GCIDE pronunciations: \A*buse"\
        text = re.sub(r"[{}]", "", text)  # cross-reference braces
        cleaned = "\n".join(reflow(p) for p in paragraphs(text))
        if len(cleaned) >= 20:
            entries.append(cleaned)
    return entries


def _b64(value: str) -> int:
    number = 0
    for ch in value:
        number = number * 64 + _B64.index(ch)
    return number


def pod_paragraphs(path: str) -> list[str]:
    out = []
    for para in paragraphs(Path(path).read_text(encoding="utf-8", errors="replace")):
        if para.startswith((" ", "\t")):
            continue  # verbatim (code) paragraph
        if para.startswith("="):
            para = para.split(None, 1)[1] if para.startswith(("=head", "=item")) and " " in para else ""
        for _ in range(3):  # nested formatting codes: C<...>, B<...>, L<text|link>, E<gt>
            para = re.sub(r"[A-Z]<+\s*([^<>|]*?)(?:\|[^<>]*)?\s*>+", r"\1", para)
        if is_prose(para):
            out.append(reflow(para))
    return out


def prose_file(path: str) -> list[str]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8", errors="replace") as f:
        text = f.read()
    return [reflow(p) for p in paragraphs(text) if is_prose(p)]


def fortunes() -> list[str]:
    out = []
    for path in sorted(glob.glob("/usr/share/games/fortunes/*")):
        if Path(path).suffix in (".dat", ".u8") or not Path(path).is_file():
            continue
        text = Path(path).read_text(encoding="utf-8", errors="replace")
        out += [q.strip("\n") for q in re.split(r"^%$", text, flags=re.M) if len(q.strip()) >= 40]
    return out


def collect(doc_chars: int) -> dict[str, list[str]]:
    """Documents per source (empty lists for packages that are not installed)."""
    sources = {
        name: group(dictd_entries(name), doc_chars) for name in ("gcide", "wn", "foldoc", "jargon", "devil")
    }
    # /usr/share/perl/5.36 links to 5.36.0: resolve links so each manual page is read once
    pods = sorted({str(Path(p).resolve()) for p in glob.glob("/usr/share/perl/*/pod/*.pod")})
    sources["perl-doc"] = [d for p in pods for d in group(pod_paragraphs(p), doc_chars)]
    git = sorted(glob.glob("/usr/share/doc/git-doc/**/*.txt", recursive=True))
    sources["git-doc"] = [d for p in git for d in group(prose_file(p), doc_chars)]
    debref = sorted(glob.glob("/usr/share/debian-reference/*.en.txt*"))
    sources["debian-reference"] = [d for p in debref for d in group(prose_file(p), doc_chars)]
    sources["fortunes"] = group(fortunes(), doc_chars)
    return sources


# ---------------------------------------------------------------- tokenizer and shards
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "offline" / "corpus"))
    parser.add_argument(
        "--tokenizer", default=None, help="existing tokenizer (hub name or folder); default: train one"
    )
    parser.add_argument(
        "--vocab-size", type=int, default=16384, help="size of the BPE trained when --tokenizer is not given"
    )
    parser.add_argument("--doc-chars", type=int, default=3000)
    parser.add_argument("--val-fraction", type=float, default=0.005)
    parser.add_argument("--shard-tokens", type=int, default=8 * 2**20)
    parser.add_argument(
        "--max-mib", type=float, default=62.0, help="stop adding documents past this corpus size"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--install", action="store_true", help=f"apt-get install {' '.join(PACKAGES)} first")
    args = parser.parse_args()

    if args.install:
        subprocess.run(["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES], check=True)
    start = time.time()
    sources = collect(args.doc_chars)
    for name, docs in sources.items():
        print(f"{name:>17}: {len(docs):6d} documents, {sum(map(len, docs)) / 1e6:6.1f} M characters")
    docs = [d for name in sources for d in sources[name]]
    if not docs:
        sys.exit(f"no text found: install the packages with `python {sys.argv[0]} --install` (as root)")
    random.Random(args.seed).shuffle(docs)
    val = [d for d in docs if zlib.crc32(d.encode()) % 10_000 < args.val_fraction * 10_000]
    train = [d for d in docs if zlib.crc32(d.encode()) % 10_000 >= args.val_fraction * 10_000]

    out = Path(args.out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if args.tokenizer is None:
        print(f"training a byte-level BPE (vocab {args.vocab_size}) on {len(train)} documents ...")
        train_bpe_tokenizer(train, args.vocab_size, tmp / "tokenizer", eos_token=EOS)
        tokenizer_name = (
            str((out / "tokenizer").relative_to(ROOT)) if out.is_relative_to(ROOT) else str(out / "tokenizer")
        )
        tokenizer_path = str(tmp / "tokenizer")
    else:
        tokenizer_name = tokenizer_path = args.tokenizer
    from twell.data import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_path)
    backend = tokenizer.backend_tokenizer
    meta = {"vocab_size": len(tokenizer), "eos_id": tokenizer.eos_token_id}
    dtype = token_dtype(len(tokenizer))  # the shards' dtype (ShardWriter picks it the same way)
    budget_tokens = int(args.max_mib * 2**20) // dtype.itemsize
    splits, total = {}, 0
    for split, texts in (("val", val), ("train", train)):
        writer = ShardWriter(tmp, split, shard_tokens=args.shard_tokens, **meta)
        for i in range(0, len(texts), 512):
            if total >= budget_tokens:
                print(
                    f"size limit --max-mib {args.max_mib} reached: {len(texts) - i} {split} documents left out"
                )
                break
            for encoding in backend.encode_batch(texts[i : i + 512], add_special_tokens=False):
                writer.add(encoding.ids)
                total += len(encoding.ids) + 1
        writer.flush()
        splits[split] = writer.shards
    write_manifest(
        tmp,
        {
            "tokenizer": tokenizer_name,
            "dtype": dtype.name,
            "splits": splits,
            "sources": {name: len(d) for name, d in sources.items()},
            "built_by": "scripts/build_corpus.py",
            **meta,
        },
    )
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)

    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    for split, shards in splits.items():
        tokens = sum(s["tokens"] for s in shards)
        docs_n = sum(s["documents"] for s in shards)
        print(f"{split}: {docs_n} documents, {tokens / 1e6:.2f} M tokens in {len(shards)} shard(s)")
    print(f"wrote {out} ({size / 2**20:.1f} MiB, tokenizer {tokenizer_name}) in {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
