"""Give a randomly initialised model the FFN activity of a trained sparse one, to time the whole model.

A model trained with the paper's L1 penalty has ~29 of 5632 hidden units active per token in every
layer, over 30% of units that never fire and heavy-tailed per-unit firing rates (PAPER.md). Timing a
decoder with TwELL kernels needs that regime; a freshly initialised model (half of its units active)
is far from it, and a training run reaches it only after thousands of steps. `calibrate_activity`
puts a random model there in one pass over a calibration batch:

* The token embeddings are rescaled to std `embedding_std` (0.5), so that they, not the attention
  outputs, dominate the residual stream. At the init's 0.02 a random model's attention outputs are
  ~40x larger at the first positions (which attend to themselves only) than further on; per-unit
  thresholds set on one batch then fit another badly: on the H200, a 0.5B model calibrated to 29
  active units showed 227 on a fresh batch, and a 12-layer CPU model 10 -> 12-78 by depth. At 0.5 the
  fresh batch shows the target within a few percent per layer, and the densest tokens still reach
  several times the mean (more so in deeper layers).
* One residual channel c becomes a constant "bias channel": every token embedding holds `beta` there
  and nothing writes to it (row c of every attention output projection and column c of every FFN down
  projection are zeroed), so after each RMSNorm it reads beta / rms(x) > 0 on every token.
* Layer by layer, in order (each layer sees the inputs that the calibrated layers before it give), unit
  j's gate weight on channel c becomes minus the threshold above which it fires on a fraction p_j of
  the calibration tokens. The p_j are drawn as the kernel benchmarks draw them
  (`kernels.synthetic.unit_firing_rates`: log-normal rates summing to `mean_active`, `dead_fraction`
  of units at zero, whose thresholds are put far above anything the batch showed).

Only weights change (no new parameters, no hooks): the model stays a plain `Transformer`, trainable
and exportable as any other. Its activity on other tokens of the same kind is close to the target, not
equal: the benchmark measures and prints it. Token-to-token spread comes from rms(x), which still
varies with position (the first positions are the densest, as in trained models), but the tail is
milder than a trained model's (the kernel benchmarks' synthetic inputs add rows of ~400 units).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from twell.kernels.synthetic import DEAD_THRESHOLD_SIGMAS, unit_firing_rates
from twell.model.transformer import Transformer

# beta in units of the embedding entries' rms: the bias channel then reads ~4 after each norm, so a
# threshold of a few sigma of the pre-activation (~2 at the init's scale) takes a gate weight below 1.
BIAS_CHANNEL_SCALE = 4.0
EMBEDDING_STD = 0.5
_UNIT_CHUNK = 1024  # units sorted at a time (memory: tokens x chunk fp32 values and int64 indices)


@dataclass
class ActivityCalibration:
    """What `calibrate_activity` set and what the calibration batch then showed, per layer."""

    channel: int  # the residual bias channel
    active_mean: list[float]  # mean active units per token
    active_max: list[float]  # most active units of any token
    never_fired: list[float]  # fraction of units active on no calibration token
    tokens: int  # calibration tokens


@torch.no_grad()
def calibrate_activity(
    model: Transformer,
    tokens: torch.Tensor,
    *,
    mean_active: float = 29.0,
    dead_fraction: float = 0.3,
    rate_sigma: float = 1.5,
    channel: int = -1,
    embedding_std: float | None = EMBEDDING_STD,
    seed: int = 0,
) -> ActivityCalibration:
    """Set `model`'s weights in place so that each FFN has ~mean_active active units per token.

    tokens: int64 [B, S] calibration batch (a few thousand tokens or more: the rates are set to its
    quantiles). The model runs in its own dtype; the dense FFN path is used whatever its ffn_impl.
    embedding_std: the token embeddings' std after rescaling (None: kept as they are).
    """
    cfg = model.cfg
    D, F = cfg.d_model, cfg.d_ff
    if tokens.dim() != 2 or tokens.dtype != torch.int64:
        raise ValueError(f"tokens must be int64 [batch, seq_len], got {tokens.dtype} {tuple(tokens.shape)}")
    if not -D <= channel < D:
        raise ValueError(f"channel={channel} is not a residual channel of d_model={D}")
    if embedding_std is not None and not embedding_std > 0:
        raise ValueError(f"embedding_std={embedding_std} must be positive (or None to keep the embeddings)")
    c = channel % D
    device = model.tok_embeddings.weight.device
    tokens = tokens.to(device)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    # Validate the targets before any weight is touched.
    unit_firing_rates(F, mean_active=mean_active, dead_fraction=dead_fraction, rate_sigma=rate_sigma, gen=gen)
    gen.manual_seed(seed)

    emb = model.tok_embeddings.weight
    if embedding_std is not None:
        emb.mul_(embedding_std / emb.float().std().clamp(min=1e-12))
    emb[:, c] = BIAS_CHANNEL_SCALE * emb.float().pow(2).mean().sqrt().to(emb.dtype)
    for block in model.layers:
        block.attn.wo.weight[c, :] = 0
        block.ffn.w_down[:, c] = 0
        block.ffn_norm.weight[c] = 1  # the channel must read positive after the norm

    seq_len = tokens.shape[1]
    cos, sin = model.rope_cos[:seq_len], model.rope_sin[:seq_len]
    x = model.tok_embeddings(tokens)
    report = ActivityCalibration(c, [], [], [], tokens.numel())
    for block in model.layers:
        h = x + block.attn(block.attn_norm(x), cos, sin)
        xn = block.ffn_norm(h).reshape(-1, D)
        rates = unit_firing_rates(
            F, mean_active=mean_active, dead_fraction=dead_fraction, rate_sigma=rate_sigma, gen=gen
        )
        _set_gate_thresholds(block.ffn.w_gate, xn, c, rates)
        y, _, stats = block.ffn._forward_dense(xn, with_stats=True)
        x = h + y.view_as(h)
        report.active_mean.append(float(stats.active_mean))
        report.active_max.append(float(stats.active_max))
        report.never_fired.append(float((stats.unit_fires == 0).float().mean()))
    return report


def _set_gate_thresholds(w_gate: torch.Tensor, xn: torch.Tensor, c: int, rates: torch.Tensor) -> None:
    """w_gate[j, c] = -t_j, where exactly round(rates_j * T) of the T rows of xn have
    (xn w_gate[j]^T without channel c) / xn[:, c] above t_j; units of rate 0 get a threshold
    DEAD_THRESHOLD_SIGMAS standard deviations above the largest value seen, live units too rare to
    fire on T rows the largest value itself."""
    bias = xn[:, c].float()
    if not bool((bias > 0).all()):
        raise ValueError("the bias channel must be positive after the FFN norm on every token")
    T = xn.shape[0]
    w_rest = w_gate.float().clone()
    w_rest[:, c] = 0
    n_fire = (rates.float() * T).round().long()
    xn32 = xn.float()
    for j0 in range(0, w_gate.shape[0], _UNIT_CHUNK):
        j1 = min(j0 + _UNIT_CHUNK, w_gate.shape[0])
        ratio = (xn32 @ w_rest[j0:j1].T) / bias[:, None]  # [T, chunk]: unit fires iff ratio > t_j
        ordered = ratio.sort(dim=0).values
        n = n_fire[j0:j1]
        # Between the (T - n)-th and (T - n + 1)-th smallest values: exactly n rows lie above.
        below = ordered.gather(0, (T - n - 1).clamp(min=0)[None]).squeeze(0)
        above = ordered.gather(0, (T - n).clamp(max=T - 1)[None]).squeeze(0)
        threshold = (below + above) / 2
        # A live unit too rare to fire on this batch sits at its largest value; a dead one far above.
        dead = rates[j0:j1] == 0
        threshold = torch.where(n == 0, ordered[-1], threshold)
        threshold = torch.where(dead, ordered[-1] + DEAD_THRESHOLD_SIGMAS * ratio.std(dim=0), threshold)
        w_gate[j0:j1, c] = (-threshold).to(w_gate.dtype)
