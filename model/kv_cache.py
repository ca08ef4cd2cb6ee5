"""A static KV cache for generation: every layer's keys and values, preallocated once.

Layout: k and v are [n_layers, batch_size, n_kv_heads, max_len, head_dim] in the model's dtype. Slot s
of row b holds position s of that row's sequence, so a slot's RoPE position is its index. A prefill
writes a right-padded batch of prompts into slots 0..S-1 (each row attends causally within its own
prompt, so the pad after a shorter prompt is never read); each decode step then writes one slot per
row, at that row's own position, and attends to the slots at or before it. Every slot a row reads was
written by its current sequence (a pad slot is overwritten by the step that reaches it), so nothing
needs clearing between calls. Shapes never change, which is what a CUDA graph of the step needs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from twell.model.config import ModelConfig


class LayerKV(NamedTuple):
    """What one attention layer writes its new keys and values into and reads them back from."""

    k: torch.Tensor  # [B, n_kv_heads, max_len, head_dim]: this layer's cache rows
    v: torch.Tensor
    positions: torch.Tensor | None  # decode: int64 [B], each row's slot for its one new token; None: prefill
    mask: torch.Tensor | None  # decode under "sdpa": bool [B, 1, 1, max_len], the slots each row attends to
    # Optional: this layer's q, k and v projections as one [(n_heads + 2 n_kv_heads) hd, d_model] weight
    # (Decoder(fuse_qkv=True)): one GEMV a token where three read the same x (generation is bound by them).
    qkv: torch.Tensor | None = None
    # How a decode step attends: "sdpa" (PyTorch's scaled_dot_product_attention under `mask`) or
    # "flash_decode" (kernels/inference/decode_attention.py: split keys, only the slots up to each row's).
    attention: str = "sdpa"

    def store(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new k, v [B, n_kv_heads, S, head_dim]; return the keys and values to attend to
        (prefill: the new ones, attended causally; decode: the whole cache, under `mask`)."""
        if self.positions is None:
            S = k.shape[2]
            self.k[:, :, :S].copy_(k)
            self.v[:, :, :S].copy_(v)
            return k, v
        # One slot per row (S == 1), at a position held on the device: no host sync. An index_put_, which
        # torch.compile writes in place (a scatter_ on the cache would be copied whole, every layer and step).
        rows = torch.arange(k.shape[0], device=k.device)
        self.k[rows, :, self.positions] = k[:, :, 0]
        self.v[rows, :, self.positions] = v[:, :, 0]
        return self.k, self.v


class KVCache:
    """Keys and values of `batch_size` sequences of up to `max_len` tokens, for every layer of `cfg`."""

    def __init__(self, cfg: ModelConfig, batch_size: int, max_len: int, *, device=None, dtype=torch.float32):
        for name, value in (("batch_size", batch_size), ("max_len", max_len)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"KV cache {name}={value!r} must be a positive integer")
        if max_len > cfg.max_seq_len:
            raise ValueError(
                f"KV cache max_len={max_len} exceeds the model's max_seq_len={cfg.max_seq_len} (its RoPE "
                f"table); ask for at most {cfg.max_seq_len} tokens (prompt + new ones)"
            )
        shape = (cfg.n_layers, batch_size, cfg.n_kv_heads, max_len, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)

    @property
    def batch_size(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def prefill_views(self, batch: int, qkv: list[torch.Tensor] | None = None) -> list[LayerKV]:
        """Per layer, the first `batch` rows, written from slot 0 by a prefill (qkv: per layer, the
        fused projection weight, see LayerKV)."""
        return [
            LayerKV(self.k[i, :batch], self.v[i, :batch], None, None, None if qkv is None else qkv[i])
            for i in range(self.k.shape[0])
        ]

    def decode_views(
        self,
        positions: torch.Tensor,
        mask: torch.Tensor | None,
        qkv: list[torch.Tensor] | None = None,
        attention: str = "sdpa",
    ) -> list[LayerKV]:
        """Per layer, the first len(positions) rows, written at `positions` by a one-token step."""
        batch = positions.shape[0]
        return [
            LayerKV(
                self.k[i, :batch],
                self.v[i, :batch],
                positions,
                mask,
                None if qkv is None else qkv[i],
                attention,
            )
            for i in range(self.k.shape[0])
        ]
