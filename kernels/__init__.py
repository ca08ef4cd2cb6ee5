"""TwELL Triton kernels and their pure-PyTorch references (depends on torch and triton only)."""

from . import reference, synthetic
from .gate import TwELLGate, twell_gate
from .inference.inference import InferenceStats, twell_ffn_inference, unit_order
from .reference import FFNOutput
from .training.train import twell_ffn

__all__ = [
    "FFNOutput",
    "InferenceStats",
    "TwELLGate",
    "reference",
    "synthetic",
    "twell_ffn",
    "twell_ffn_inference",
    "twell_gate",
    "unit_order",
]
