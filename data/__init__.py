"""Text source -> tokens -> packed, resumable micro-batches (docs/CONTRACTS.md, "data/")."""

from data.config import DataConfig
from data.stream import PackedStream, ValidationBatches, build_train_stream, build_val_stream, held_out_texts
from data.tokenizer import load_tokenizer

__all__ = [
    "DataConfig",
    "PackedStream",
    "ValidationBatches",
    "build_train_stream",
    "build_val_stream",
    "held_out_texts",
    "load_tokenizer",
]
