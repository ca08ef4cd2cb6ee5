"""Paper-like FFN inputs for tests and benchmarks (torch only).

The released sparse models have ~29 of 5632 hidden units active per token, over 30% of units never
firing, heavy-tailed per-unit firing rates and a few much denser rows (the first tokens of a
sequence). We reproduce those statistics with random weights by giving every unit j a target firing
rate p_j and shifting its gate pre-activation by a threshold tau_j:

* x's last feature is a constant 1 (a "bias channel"), the other features are N(0, 1) times a
  per-row scale s_m; w_gate[j, -1] = -tau_j. The pre-activation of unit j on row m is then exactly
  s_m * N(0, |w_gate[j, :-1]|^2) - tau_j, so tau_j = |w_gate[j, :-1]| * Phi^-1(1 - p_j) makes unit j
  fire on a fraction p_j of unit-scale rows. No calibration batch is needed.
* Per-unit rates are log-normal (sigma 1.5: the top 26% of live units then carry ~80% of the
  activations, the skew reported for ReLU LLMs), dead units get tau = 12 sigma (never fire).
* Per-row scales are log-normal (heavy-tailed active counts); a small fraction of rows get a large
  scale (dense rows with ~10-30x the mean active units).

The helpers below build the hard patterns the kernels must survive, using the same bias channel.
"""

from __future__ import annotations

import math

import torch

DEAD_THRESHOLD_SIGMAS = 12.0


def _generator(device: torch.device, seed: int) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def unit_firing_rates(
    F: int, *, mean_active: float, dead_fraction: float, rate_sigma: float, gen: torch.Generator
) -> torch.Tensor:
    """Per-unit firing probabilities (float32 [F] on gen's device) with sum ~= mean_active."""
    device = gen.device
    if not 0.0 <= dead_fraction < 1.0:
        raise ValueError(f"dead_fraction={dead_fraction} must be in [0, 1)")
    if not 0.0 < mean_active < F * (1 - dead_fraction) * 0.5:
        raise ValueError(
            f"mean_active={mean_active} must be in (0, live units / 2) for d_ff={F}, dead_fraction={dead_fraction}"
        )
    rates = torch.exp(rate_sigma * torch.randn(F, generator=gen, device=device))
    dead = torch.randperm(F, generator=gen, device=device)[: int(round(dead_fraction * F))]
    rates[dead] = 0.0
    # Rescale to the target mean, capping single units at 0.5 (a unit firing on most tokens is not sparse).
    for _ in range(8):
        rates = (rates * (mean_active / rates.sum())).clamp(max=0.5)
    return rates


def paper_like_ffn_inputs(
    M: int,
    D: int,
    F: int,
    *,
    mean_active: float = 29.0,
    dead_fraction: float = 0.3,
    rate_sigma: float = 1.5,
    row_sigma: float = 0.12,
    dense_row_fraction: float = 0.002,
    dense_row_scale: float = 2.2,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, D], w_gate, w_up, w_down [F, D] (w_down neuron-major) with paper-like activity.

    Unit-scale rows have mean_active active units on average; heavy-tailed rows (row_sigma) and
    dense rows (dense_row_fraction of rows, scaled by dense_row_scale) add the long tail.
    """
    device = torch.device(device)
    gen = _generator(device, seed)
    rates = unit_firing_rates(
        F, mean_active=mean_active, dead_fraction=dead_fraction, rate_sigma=rate_sigma, gen=gen
    )
    std = 1.0 / math.sqrt(D)
    w_gate = torch.randn(F, D, generator=gen, device=device) * std
    w_up = torch.randn(F, D, generator=gen, device=device) * std
    w_down = torch.randn(F, D, generator=gen, device=device) * std
    scale = torch.exp(row_sigma * torch.randn(M, 1, generator=gen, device=device))
    n_dense = int(round(dense_row_fraction * M))
    if n_dense:
        dense_rows = torch.randperm(M, generator=gen, device=device)[:n_dense]
        scale[dense_rows] = dense_row_scale
    z = _thresholds_for_mean(rates, mean_active, row_sigma, dense_row_fraction, dense_row_scale, gen)
    w_gate[:, -1] = -z * w_gate[:, :-1].norm(dim=1)
    x = torch.randn(M, D, generator=gen, device=device) * scale
    x[:, -1] = 1.0
    return tuple(t.to(dtype).contiguous() for t in (x, w_gate, w_up, w_down))


def _thresholds_for_mean(
    rates: torch.Tensor,
    mean_active: float,
    row_sigma: float,
    dense_row_fraction: float,
    dense_row_scale: float,
    gen: torch.Generator,
) -> torch.Tensor:
    """Standardised thresholds z_j (tau_j / |w_j|) whose expected active count per row, over the row-scale
    distribution (log-normal rows plus dense rows), equals mean_active; rates keep their relative sizes."""
    device = rates.device
    normal = torch.distributions.Normal(torch.tensor(0.0, device=device), torch.tensor(1.0, device=device))
    scales = torch.exp(row_sigma * torch.randn(512, generator=gen, device=device))
    weights = torch.full_like(scales, (1.0 - dense_row_fraction) / scales.numel())
    scales = torch.cat([scales, torch.tensor([dense_row_scale], device=device)])
    weights = torch.cat([weights, torch.tensor([dense_row_fraction], device=device)])
    live = rates > 0
    target = rates.clone()
    z = torch.full_like(rates, DEAD_THRESHOLD_SIGMAS)
    for _ in range(6):
        z = torch.where(live, normal.icdf((1.0 - target).clamp(1e-12, 1 - 1e-7)), z)
        fire = 1.0 - normal.cdf(z[None, :] / scales[:, None])  # [scales, F]
        expected = (weights[:, None] * fire).sum()
        target = (target * (mean_active / expected)).clamp(max=0.5)
    return z


# ---- hard patterns (modify in place, return the argument) -------------------------------------------


def make_rows_silent(x: torch.Tensor, rows) -> torch.Tensor:
    """No unit fires on these rows: only the bias channel is left, so every pre-activation is -tau_j < 0."""
    x[rows, :-1] = 0
    return x


def make_rows_dense(x: torch.Tensor, rows) -> torch.Tensor:
    """Every unit fires on these rows: the bias channel is flipped, so every pre-activation is +tau_j > 0."""
    x[rows, :-1] = 0
    x[rows, -1] = -1
    return x


def make_units_always_active(w_gate: torch.Tensor, units) -> torch.Tensor:
    """These units fire on (almost) every row with a unit-scale or silent input: a large positive bias."""
    w_gate[units, -1] = 20.0
    return w_gate


def make_rows_heavy_tailed(x: torch.Tensor, rows, *, seed: int = 0, alpha: float = 1.5) -> torch.Tensor:
    """Scale rows by Pareto(alpha) factors (>= 1): a few rows get far more active units than the rest."""
    gen = _generator(x.device, seed)
    idx = torch.as_tensor(rows, device=x.device).reshape(-1)
    u = torch.rand(idx.numel(), generator=gen, device=x.device).clamp(min=1e-3)
    factors = u.pow(-1.0 / alpha).clamp(max=4.0).to(x.dtype)
    x[idx, :-1] *= factors[:, None]
    return x
