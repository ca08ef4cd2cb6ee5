"""Pure-PyTorch ground truth for the TwELL kernels: the dense ReLU-gated FFN."""

from __future__ import annotations

from typing import NamedTuple

import torch


class FFNOutput(NamedTuple):
    """Output of a ReLU-gated FFN (shared by the reference and the training op)."""

    y: torch.Tensor  # [M, D], dtype of x
    l1: (
        torch.Tensor
    )  # float32 scalar (float64 for float64 inputs): mean over rows of sum over d_ff of |h| (differentiable)
    row_active: torch.Tensor  # int32 [M]: active hidden units per row
    unit_fires: torch.Tensor  # int32 [F]: rows in which each hidden unit was active
    overflow_rows: torch.Tensor  # int32 0-dim: rows routed through an overflow path (0 here)


def relu_ffn(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> FFNOutput:
    """y = (relu(x w_gate^T) * (x w_up^T)) w_down, computed in x's dtype as a dense FFN would.

    Differentiable w.r.t. all four inputs. w_down is neuron-major [F, D]. The L1 term is reduced in
    float32 (a sum over thousands of units) but its gradient flows back into x's dtype.
    """
    gate_pre = x @ w_gate.T
    h = torch.relu(gate_pre) * (x @ w_up.T)
    y = h @ w_down
    l1 = h.to(torch.promote_types(h.dtype, torch.float32)).abs().sum(dim=-1).mean()
    active = gate_pre > 0
    return FFNOutput(
        y=y,
        l1=l1,
        row_active=active.sum(dim=-1, dtype=torch.int32),
        unit_fires=active.sum(dim=0, dtype=torch.int32),
        overflow_rows=torch.zeros((), dtype=torch.int32, device=x.device),
    )


@torch.no_grad()
def relu_ffn_inference(
    x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor
) -> torch.Tensor:
    """Just y of relu_ffn, without autograd (the twin of kernels.twell_ffn_inference)."""
    return (torch.relu(x @ w_gate.T) * (x @ w_up.T)) @ w_down


@torch.no_grad()
def twell_gate_reference(
    x: torch.Tensor, w_gate: torch.Tensor, tile_n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense twin of kernels.twell_gate: (gate values relu(x w_gate^T) [M, F], true counts [M, T])."""
    g = torch.relu(x @ w_gate.T)
    m, f = g.shape
    tiles = -(-f // tile_n)
    padded = torch.nn.functional.pad(g > 0, (0, tiles * tile_n - f))
    return g, padded.view(m, tiles, tile_n).sum(dim=-1, dtype=torch.int32)
