"""Plain PyTorch model code: config, transformer, ReLU-gated FFN."""

from model.config import PRESETS, ModelConfig
from model.ffn import FFNStats, ReLUGatedFFN
from model.transformer import ActivityStats, Transformer, TransformerOutput

__all__ = [
    "PRESETS",
    "ActivityStats",
    "FFNStats",
    "ModelConfig",
    "ReLUGatedFFN",
    "Transformer",
    "TransformerOutput",
]
