"""Model configuration: the paper's presets and a validated dataclass.

`ModelConfig` is also the Hydra structured-config schema of the `model` config group, so its
fields are plain typed values only (no nested objects, no tensors).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from twell.kernels._common import check_hot_units

FFN_IMPLS = ("dense", "twell", "auto")
# The default model.twell_threshold, and what "auto" routes by where no break-even is measured (a CPU
# run) or can be (training/routing.py).
TWELL_THRESHOLD_FALLBACK = 50.0

# The paper's sizes (PAPER.md "Model"): only the depth changes between 0.5B and 2B.
_PAPER_SHAPE = dict(
    vocab_size=49152,
    d_model=2048,
    n_heads=32,
    n_kv_heads=32,
    d_ff=5632,
    max_seq_len=2048,
    rope_theta=100000.0,
    tie_embeddings=True,
)

PRESETS: dict[str, dict] = {
    # CPU-friendly: quickstart runs and tests. vocab 4096 matches the small offline tokenizer;
    # override vocab_size if the tokenizer differs.
    "tiny": dict(vocab_size=4096, d_model=128, n_layers=2, n_heads=4, d_ff=384, max_seq_len=512),
    "0.5b": dict(_PAPER_SHAPE, n_layers=8),
    "1b": dict(_PAPER_SHAPE, n_layers=18),
    "1.5b": dict(_PAPER_SHAPE, n_layers=28),
    "2b": dict(_PAPER_SHAPE, n_layers=38),
}


def _check_threshold(value) -> float | str:
    """twell_threshold as "auto" or a float > 0."""
    if value == "auto":
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return float(value)
    raise ValueError(
        f"twell_threshold={value!r} must be auto (the break-even measured on the GPU) or a number of "
        "active units per token > 0; set e.g. model.twell_threshold=auto or model.twell_threshold=50"
    )


@dataclass
class ModelConfig:
    """Shape and behaviour of a `Transformer`. Defaults are the `tiny` preset's shape."""

    vocab_size: int = 4096
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int | None = None  # None: = n_heads (plain multi-head attention)
    d_ff: int = 384
    max_seq_len: int = 512
    rope_theta: float = 100000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    tie_embeddings: bool = True
    ffn_impl: str = "dense"  # "dense" | "twell" | "auto" (per layer, by measured activity)
    # "auto" impl: a layer goes sparse while its mean active units/token is below this: a number, or
    # "auto" (the break-even of TwELL and dense measured on the GPU at start, or cached for it:
    # training/routing.py; TWELL_THRESHOLD_FALLBACK where none is). Any: a number or a string.
    # 50 (measured: the paper_1.5b trainer +28.5% with it); "auto" times the FFN layer alone, host-bound
    # at 16k tokens, and routed nothing sparse on an H200 (training/routing.py): opt-in until it measures
    # what a layer costs inside the model.
    twell_threshold: Any = TWELL_THRESHOLD_FALLBACK
    twell_check_interval: int = 20  # "auto": optimizer steps between routing re-checks (trainer)
    # TwELL: the K most-firing units of a batch on dense GEMMs (0: off; None: the kernels' default,
    # 1024 from 16384 tokens per call on a GPU; docs/KERNELS.md)
    twell_hot_units: int | None = None
    name: str = ""  # preset name, "" for a custom shape

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        for field in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "max_seq_len"):
            value = getattr(self, field)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{field}={value!r} must be a positive integer")
        self.twell_threshold = _check_threshold(self.twell_threshold)
        for field in ("rope_theta", "norm_eps", "init_std"):
            value = getattr(self, field)
            if not value > 0:
                raise ValueError(f"{field}={value!r} must be positive")
        if self.twell_check_interval <= 0:
            raise ValueError(f"twell_check_interval={self.twell_check_interval} must be a positive integer")
        check_hot_units(self.twell_hot_units, "twell_hot_units", default="null")
        if self.d_model % 64:
            raise ValueError(f"d_model={self.d_model} must be a multiple of 64 (the FFN kernels tile by 64)")
        if self.d_ff % 64:
            raise ValueError(f"d_ff={self.d_ff} must be a multiple of 64 (the FFN kernels tile by 64)")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"d_model={self.d_model} must be divisible by n_heads={self.n_heads}; "
                f"pick n_heads among the divisors of d_model"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"head_dim = d_model / n_heads = {self.head_dim} must be even for RoPE; change n_heads"
            )
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads} "
                f"(each KV head serves a whole group of query heads)"
            )
        if self.ffn_impl not in FFN_IMPLS:
            raise ValueError(f"ffn_impl={self.ffn_impl!r} is not one of {FFN_IMPLS}")

    @property
    def routing_threshold(self) -> float:
        """The threshold a model routes by on its own: twell_threshold, or the fallback when it is "auto"
        (the trainer resolves "auto" to a measured break-even and passes it to update_ffn_routing)."""
        return TWELL_THRESHOLD_FALLBACK if self.twell_threshold == "auto" else self.twell_threshold

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @classmethod
    def preset(cls, name: str, **overrides) -> ModelConfig:
        """A named size (tiny, 0.5b, 1b, 1.5b, 2b) with optional field overrides."""
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; valid presets: {', '.join(PRESETS)}")
        unknown = set(overrides) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(
                f"unknown ModelConfig field(s) {sorted(unknown)} in overrides of preset {name!r}"
            )
        return cls(**{**PRESETS[name], "name": name, **overrides})

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameter count, computed from the shape (no model needed).

        Tied embeddings count once. `non_embedding=True` leaves out the token embedding (an untied
        output head stays in: it is a real matmul per token).
        """
        d, hd = self.d_model, self.head_dim
        attn = d * self.n_heads * hd * 2 + d * self.n_kv_heads * hd * 2  # wq, wo, wk, wv
        ffn = 3 * d * self.d_ff
        per_layer = attn + ffn + 2 * d  # + two RMSNorm weights
        total = self.n_layers * per_layer + d  # + final norm
        if not self.tie_embeddings:
            total += self.vocab_size * d
        if not non_embedding:
            total += self.vocab_size * d
        return total

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token (forward + backward), the MFU numerator of PAPER.md:

            6 N + 6 L d S

        N = ALL parameters (num_params(), the tied embedding once: it is the LM-head matmul),
        L = n_layers, d = d_model, S = seq_len (the attention score/value matmuls, causal).
        This N reproduces the paper's figures for 1.5B on a 989 TFLOP/s H200: 51.4k tokens/s ->
        51.7% MFU ("~52%") and 39.7k -> 39.9% ("~40%"); non-embedding N would give 48.5% / 37.5%.
        """
        return 6 * self.num_params() + 6 * self.n_layers * self.d_model * seq_len
