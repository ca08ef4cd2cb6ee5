"""Plain PyTorch model code: config, transformer, ReLU-gated FFN."""

from twell.model.config import PRESETS, ModelConfig
from twell.model.ffn import FFNStats, ReLUGatedFFN
from twell.model.transformer import ActivityStats, Transformer, TransformerOutput

__all__ = [
    "PRESETS",
    "ActivityStats",
    "FFNStats",
    "ModelConfig",
    "ReLUGatedFFN",
    "Transformer",
    "TransformerOutput",
]
