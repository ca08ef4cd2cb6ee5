import random
import string

import pytest


def _random_text(rng: random.Random, n_words: int) -> str:
    words = ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(1, 8))) for _ in range(n_words)]
    return " ".join(words).capitalize() + "."


@pytest.fixture(scope="session")
def tiny_tokenizer():
    """A byte-level BPE tokenizer (vocab 512) trained here on fresh random text: no hub, no files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random()
    corpus = [_random_text(rng, 30) for _ in range(300)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", model_max_length=256)
