"""The decoder: token embedding -> pre-norm blocks (attention, ReLU-gated FFN) -> RMSNorm -> tied head."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from twell.model.config import ModelConfig
from twell.model.ffn import FFNStats, ReLUGatedFFN
from twell.model.layers import Attention, RMSNorm, rope_cos_sin

if TYPE_CHECKING:
    from twell.model.generate import GenerationOutput
    from twell.model.kv_cache import LayerKV


@dataclass
class ActivityStats:
    """Per-layer FFN activity of one forward; detached device tensors, built without host syncs."""

    active_mean: torch.Tensor  # float32 [L]: mean active units per token
    active_max: torch.Tensor  # float32 [L]: max active units of any token
    unit_fires: torch.Tensor  # int32 [L, F]: tokens of this forward in which each unit fired
    overflow_rows: torch.Tensor  # int32 [L]: rows routed through a kernel's overflow path (0 on dense)
    tokens: int  # tokens in this forward


@dataclass
class TransformerOutput:
    logits: torch.Tensor  # [B, S, V]
    l1: torch.Tensor | None  # fp32 scalar: mean over layers of mean over tokens of sum over units |h|
    stats: ActivityStats | None  # None when forward(..., with_stats=False)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.ffn = ReLUGatedFFN(cfg.d_model, cfg.d_ff, cfg.ffn_impl, cfg.init_std, cfg.twell_hot_units)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        with_stats: bool = True,
        kv: LayerKV | None = None,
        dense_ffn: bool = False,
    ):
        x = x + self.attn(self.attn_norm(x), cos, sin, kv)
        y, l1, stats = self.ffn(self.ffn_norm(x), with_stats, dense=dense_ffn)
        return x + y, l1, stats


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        # RoPE tables derive from the config, so they are not saved; init_weights() fills them.
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """The paper's init: every matrix ~ N(0, init_std), norm weights 1, RoPE tables, dense routing.

        Call after `to_empty(device=...)` to materialise a model built on the meta device.
        """
        std = self.cfg.init_std
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, (RMSNorm, ReLUGatedFFN)):
                module.reset_parameters()
        # fp32 tables on the weights' device (after to_empty() the old buffers hold garbage).
        device = self.tok_embeddings.weight.device
        self.rope_cos, self.rope_sin = rope_cos_sin(
            self.cfg.head_dim, self.cfg.max_seq_len, self.cfg.rope_theta, device=device
        )

    def output_weight(self) -> torch.Tensor:
        return self.tok_embeddings.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, tokens: torch.Tensor, with_stats: bool = True) -> TransformerOutput:
        """tokens int64 [B, S] -> logits [B, S, V], the L1 term and per-layer activity statistics.

        with_stats=False (evaluation, generation) returns l1=None and stats=None and lets sparse
        layers use the fused inference kernel under torch.no_grad().
        """
        x, l1s, layer_stats = self._decoder(tokens, with_stats)
        logits = F.linear(x, self.output_weight())
        if not with_stats:
            return TransformerOutput(logits=logits, l1=None, stats=None)
        return TransformerOutput(
            logits=logits, l1=torch.stack(l1s).mean(), stats=_stack_stats(layer_stats, tokens.numel())
        )

    def hidden_states(
        self,
        tokens: torch.Tensor,
        kv: list[LayerKV] | None = None,
        positions: torch.Tensor | None = None,
        run_block=None,
        run_norm=None,
    ) -> torch.Tensor:
        """tokens int64 [B, S] -> the final RMSNorm's output [B, S, d_model]: the decoder stack without
        the output head (as HF's `LlamaModel`), no L1 or statistics (inference kernels under no_grad).

        Generation (model/generate.py): kv, one KV cache layer per block (model/kv_cache.py), and
        positions, int64 [B, S] RoPE positions per sequence (None: 0..S-1, a prefill's); run_block and
        run_norm, callers of the blocks and the final norm (see _decoder)."""
        return self._decoder(tokens, False, kv, positions, run_block, run_norm)[0]

    def generate(self, prompts, max_new_tokens: int, **options) -> GenerationOutput:
        """Continue each prompt (token ids) by up to max_new_tokens tokens with a KV cache: greedy by
        default; options as `twell.model.generate.generate` (temperature, top_k, top_p, eos_token_id,
        generator, on_token, decoder, cuda_graph)."""
        from twell.model.generate import generate

        return generate(self, prompts, max_new_tokens, **options)

    def _decoder(
        self, tokens: torch.Tensor, with_stats: bool, kv=None, positions=None, run_block=None, run_norm=None
    ):
        """The stack: embeddings, blocks, final norm. run_block(block, x, cos, sin, with_stats, kv) and
        run_norm(norm, x), when given, call the blocks and the norm in their place (generation passes
        compiled callers of them)."""
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be [batch, seq_len], got shape {tuple(tokens.shape)}")
        if positions is None:
            seq_len = tokens.shape[1]
            if seq_len > self.cfg.max_seq_len:
                raise ValueError(
                    f"sequence length {seq_len} exceeds max_seq_len={self.cfg.max_seq_len}; "
                    f"shorten the input or build the model with a larger max_seq_len"
                )
            cos, sin = self.rope_cos[:seq_len], self.rope_sin[:seq_len]
        else:  # per-sequence positions (checked by the caller): [B, 1, S, hd], broadcast over heads
            cos, sin = self.rope_cos[positions].unsqueeze(1), self.rope_sin[positions].unsqueeze(1)
        x = self.tok_embeddings(tokens)
        l1s, layer_stats = [], []
        for i, block in enumerate(self.layers):
            args = (x, cos, sin, with_stats, None if kv is None else kv[i])
            x, l1, stats = block(*args) if run_block is None else run_block(block, *args)
            l1s.append(l1)
            layer_stats.append(stats)
        return (self.norm(x) if run_norm is None else run_norm(self.norm, x)), l1s, layer_stats

    @torch.no_grad()
    def order_ffn_units(self, tokens: torch.Tensor, hot_prefix: int = 512) -> list[float]:
        """Inference preparation: store every FFN's units most-firing first (counted on `tokens`, int64
        [B, S] calibration tokens, a few thousand or more) and compute the first `hot_prefix` of them
        densely on tensor cores in the TwELL inference kernels (kernels.twell_ffn_inference's
        hot_prefix; 0 reorders only). The model's function is unchanged. Returns, per layer, the share
        of the calibration tokens' active units that fall in the prefix."""
        from twell.kernels import unit_order
        from twell.kernels._common import check_hot_prefix

        hot_prefix = check_hot_prefix(hot_prefix, self.cfg.d_ff)
        _, _, layer_stats = self._decoder(tokens, with_stats=True)
        shares = []
        for block, stats in zip(self.layers, layer_stats):
            fires = stats.unit_fires.long()
            order = unit_order(fires)
            block.ffn.reorder_units(order)
            block.ffn.hot_prefix = hot_prefix
            shares.append(float(fires[order[:hot_prefix]].sum() / fires.sum().clamp(min=1)))
        return shares

    def update_ffn_routing(self, active_mean: torch.Tensor, threshold: float | None = None) -> list[bool]:
        """ "auto" impl: layer i takes the sparse path iff active_mean[i] < threshold (default:
        cfg.routing_threshold, the configured number, or the fallback 50 where it is "auto"; the trainer
        passes the break-even it measured or loaded, training/routing.py).

        Call every cfg.twell_check_interval steps with the (all-reduced) per-layer mean active
        units; it reads active_mean on the host once. Returns the new per-layer flags.
        """
        if active_mean.numel() != len(self.layers):
            raise ValueError(
                f"active_mean has {active_mean.numel()} entries; the model has {len(self.layers)} layers"
            )
        if threshold is None:
            threshold = self.cfg.routing_threshold
        flags = [value < threshold for value in active_mean.detach().float().cpu().tolist()]
        for block, flag in zip(self.layers, flags):
            block.ffn.set_sparse(flag)
        return flags

    def ffn_routing(self) -> list[bool]:
        """Per-layer flags: True where the FFN currently takes the sparse (TwELL) path."""
        return [block.ffn._sparse_now for block in self.layers]

    def num_params(self, non_embedding: bool = False) -> int:
        """Counted from the live parameters (tied weights once); equals cfg.num_params()."""
        total = sum(p.numel() for p in self.parameters())
        return total - self.tok_embeddings.weight.numel() if non_embedding else total


def _stack_stats(layer_stats: list[FFNStats], tokens: int) -> ActivityStats:
    return ActivityStats(
        active_mean=torch.stack([s.active_mean for s in layer_stats]),
        active_max=torch.stack([s.active_max for s in layer_stats]),
        unit_fires=torch.stack([s.unit_fires for s in layer_stats]),
        overflow_rows=torch.stack([s.overflow_rows for s in layer_stats]),
        tokens=tokens,
    )
