"""RMSNorm, rotary position embeddings and causal self-attention (LLaMA conventions).

The layouts follow Hugging Face's Llama exactly (rotate-half RoPE, separate q/k/v/o projections
in nn.Linear layout) so our weights map 1:1 onto a `LlamaForCausalLM` folder and back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from twell.model.config import ModelConfig

if TYPE_CHECKING:
    from twell.model.kv_cache import LayerKV


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 even under bf16 autocast: the mean of squares loses too much in bf16.
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def rope_cos_sin(
    head_dim: int, max_seq_len: int, theta: float, device=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables [max_seq_len, head_dim] in fp32, rotate-half layout (frequencies repeated)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    positions = torch.arange(max_seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, H, S, hd] by position: pairs are (i, i + hd/2), as in HF Llama's rotate_half."""
    x32 = x.float()
    half = x.shape[-1] // 2
    rotated = torch.cat([-x32[..., half:], x32[..., :half]], dim=-1)
    return (x32 * cos + rotated * sin).to(x.dtype)


def _flash_decode(q, k, v, positions):
    """A decode step's attention through the Triton kernel (one opaque node when torch.compile traces)."""
    if torch.compiler.is_compiling():
        return torch.ops.twell.decode_attention(q, k, v, positions)
    from twell.kernels.inference.decode_attention import decode_attention

    return decode_attention(q, k, v, positions)


class Attention(nn.Module):
    """Causal multi-head attention with RoPE; grouped-query when n_kv_heads < n_heads."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: LayerKV | None = None
    ) -> torch.Tensor:
        """x [B, S, D] -> [B, S, D]. cos, sin: [S, hd], or [B, 1, S, hd] per sequence (generation).
        kv: a KV cache layer (model/kv_cache.py) that the keys and values are written to; a decode
        step attends to the cache under its mask, a prefill causally to its own tokens."""
        B, S, _ = x.shape
        if kv is not None and kv.qkv is not None:  # generation: one fused projection (same values)
            q, k, v = F.linear(x, kv.qkv).split(
                [
                    self.n_heads * self.head_dim,
                    self.n_kv_heads * self.head_dim,
                    self.n_kv_heads * self.head_dim,
                ],
                dim=-1,
            )
        else:
            q, k, v = self.wq(x), self.wk(x), self.wv(x)
        q = q.view(B, S, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(B, S, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(B, S, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        mask = None
        if kv is not None:
            k, v = kv.store(k, v)
            mask = kv.mask
        if kv is not None and kv.positions is not None and kv.attention == "flash_decode":
            out = _flash_decode(q, k, v, kv.positions)
        else:
            # enable_gqa: query head h reads KV head h // (n_heads / n_kv_heads), HF's repeat_kv order.
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=self.n_kv_heads != self.n_heads
            )
        return self.wo(out.transpose(1, 2).reshape(B, S, self.n_heads * self.head_dim))
