"""Text source -> tokens -> packed, resumable micro-batches (docs/CONTRACTS.md, "data/")."""

from twell.data.config import DataConfig
from twell.data.stream import (
    PackedStream,
    ValidationBatches,
    build_train_stream,
    build_val_stream,
    held_out_texts,
)
from twell.data.tokenizer import load_tokenizer

__all__ = [
    "DataConfig",
    "PackedStream",
    "ValidationBatches",
    "build_train_stream",
    "build_val_stream",
    "held_out_texts",
    "load_tokenizer",
]
