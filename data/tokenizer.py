"""Load the transformers fast tokenizer named by data.tokenizer (hub name or local folder)."""

from __future__ import annotations

import os
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerFast

from twell.data.config import CORPUS_TOKENIZER
from twell.data.paths import resolve_path

_OFFLINE_FIX = (
    "run `python scripts/prepare_offline_data.py` and use data.tokenizer=offline/tokenizer, or point "
    "data.tokenizer at a local tokenizer folder"
)


def load_tokenizer(name_or_path: str) -> PreTrainedTokenizerFast:
    """A fast tokenizer with an EOS token; clear errors for a missing folder or an uncached hub name offline."""
    if not name_or_path:
        raise ValueError(f"data.tokenizer is empty: {_OFFLINE_FIX}")
    if name_or_path == CORPUS_TOKENIZER and not resolve_path(name_or_path).is_dir():
        raise ValueError(
            "data.tokenizer=corpus (a token corpus's own tokenizer) is filled in from the corpus manifest "
            "by train.py; here give the tokenizer itself: data.tokenizer=<hub name or local folder>"
        )
    local = resolve_path(name_or_path)
    if local.is_dir():
        tokenizer = _from_pretrained(str(local), name_or_path, local=True)
    elif _looks_like_path(name_or_path):
        raise FileNotFoundError(f"tokenizer folder {name_or_path!r} does not exist: {_OFFLINE_FIX}")
    else:
        tokenizer = _from_pretrained(name_or_path, name_or_path, local=False)

    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        raise ValueError(
            f"tokenizer {name_or_path!r} loaded as {type(tokenizer).__name__}, not a fast (Rust) tokenizer; "
            "save it with tokenizer.json or pick a tokenizer that has one"
        )
    if tokenizer.eos_token_id is None:
        raise ValueError(
            f"tokenizer {name_or_path!r} has no EOS token, which joins documents in packed rows; "
            "set eos_token in its tokenizer_config.json (e.g. '<|endoftext|>')"
        )
    return tokenizer


def train_bpe_tokenizer(
    texts: list[str], vocab_size: int, out_dir: str | Path, eos_token: str = "<|endoftext|>"
) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on texts (eos_token as its only special token, also the BOS), saved in out_dir."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[eos_token],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer, length=len(texts))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token=eos_token, bos_token=eos_token, model_max_length=2**30
    )
    tokenizer.save_pretrained(str(out_dir))
    return tokenizer


def _from_pretrained(target: str, name: str, *, local: bool) -> PreTrainedTokenizerFast:
    try:
        return AutoTokenizer.from_pretrained(target, use_fast=True)
    except (OSError, ValueError) as err:
        if local:
            raise ValueError(f"cannot load tokenizer folder {name!r} ({err}); {_OFFLINE_FIX}") from err
        offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")
        why = "HF_HUB_OFFLINE=1 and it is not in the local HF cache" if offline else str(err)
        raise ValueError(
            f"cannot load tokenizer {name!r} from the hub: {why}. Fix: download it once with internet "
            f"(python -c \"from transformers import AutoTokenizer; AutoTokenizer.from_pretrained('{name}')\"), "
            f"or {_OFFLINE_FIX}"
        ) from err


def _looks_like_path(name: str) -> bool:
    # Hub ids are "name" or "org/name"; path syntax, a first part that is a local folder (e.g.
    # "offline/tokenizr") or our offline folder (the default offline/tokenizer, not built yet) means a
    # folder was meant.
    if name.startswith((".", "/", "~", "offline/")) or name.count("/") > 1 or "\\" in name:
        return True
    return "/" in name and resolve_path(name.split("/")[0]).is_dir()
