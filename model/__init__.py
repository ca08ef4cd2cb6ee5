"""Plain PyTorch model code: config, transformer, ReLU-gated FFN."""

from twell.model.config import PRESETS, ModelConfig
from twell.model.ffn import FFNStats, ReLUGatedFFN
from twell.model.generate import Decoder, GenerationOutput
from twell.model.kv_cache import KVCache
from twell.model.transformer import ActivityStats, Transformer, TransformerOutput

__all__ = [
    "PRESETS",
    "ActivityStats",
    "Decoder",
    "FFNStats",
    "GenerationOutput",
    "KVCache",
    "ModelConfig",
    "ReLUGatedFFN",
    "Transformer",
    "TransformerOutput",
]
