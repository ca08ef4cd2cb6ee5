"""TwELL Triton kernels and their pure-PyTorch references (depends on torch and triton only)."""

from . import reference, synthetic
from .gate import TwELLGate, twell_gate
from .reference import FFNOutput

# Training op (issue 4): add `from .train import twell_ffn` here once kernels/train.py exists.

__all__ = ["FFNOutput", "TwELLGate", "reference", "synthetic", "twell_gate"]
