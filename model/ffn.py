"""The ReLU-gated feed-forward block: y = (relu(x W_g^T) * (x W_u^T)) W_d, dense or TwELL-sparse.

All three weights are [d_ff, d_model]: w_gate and w_up in nn.Linear layout, w_down neuron-major
(the transpose of nn.Linear's down weight), which is what the TwELL kernels read row by row.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn


class FFNStats(NamedTuple):
    """Activity of one FFN call; detached device tensors (no host sync to build them)."""

    active_mean: torch.Tensor  # float32 0-dim: mean active units per token
    active_max: torch.Tensor  # float32 0-dim: max active units of any token
    unit_fires: torch.Tensor  # int32 [F]: tokens in which each unit fired
    overflow_rows: torch.Tensor  # int32 0-dim: rows that took a kernel's overflow path (0 when dense)


def _stats_from_row_active(
    row_active: torch.Tensor, unit_fires: torch.Tensor, overflow_rows: torch.Tensor
) -> FFNStats:
    row_active = row_active.float()
    return FFNStats(
        active_mean=row_active.mean(),
        active_max=row_active.max(),
        unit_fires=unit_fires.to(torch.int32),
        overflow_rows=overflow_rows.to(torch.int32),
    )


def kernels_usable(x: torch.Tensor) -> bool:
    """Triton kernels run on CUDA, or on CPU under the interpreter; otherwise use the reference path."""
    return x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def _import_kernels():
    try:
        from twell import kernels
    except ImportError as err:  # pragma: no cover - depends on the installation
        raise ImportError(
            f"ffn_impl='twell' needs twell.kernels (torch + triton): {err}. Install triton or use ffn_impl='dense'."
        ) from err
    return kernels


class ReLUGatedFFN(nn.Module):
    """ReLU-gated FFN with an implementation switch.

    impl "dense": PyTorch matmuls. "twell": the TwELL Triton kernels (dense reference path on CPU
    without TRITON_INTERPRET=1). "auto": per layer, sparse while `use_sparse` is set by
    `Transformer.update_ffn_routing`, dense otherwise (dense at start: early training is dense).
    """

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        impl: str = "dense",
        init_std: float = 0.02,
        hot_units: int | None = None,
    ):
        super().__init__()
        self.d_model, self.d_ff, self.impl, self.init_std = d_model, d_ff, impl, init_std
        self.hot_units = hot_units  # TwELL hot units (None: the kernels' default; see ModelConfig)
        # Inference: the first hot_prefix units are computed densely (set by Transformer.order_ffn_units,
        # which stores the units most-firing first; 0: off). Not saved: the order lives in the weights.
        self.hot_prefix = 0
        self.w_gate = nn.Parameter(torch.empty(d_ff, d_model))
        self.w_up = nn.Parameter(torch.empty(d_ff, d_model))
        self.w_down = nn.Parameter(torch.empty(d_ff, d_model))
        # Persistent so a resumed "auto" run keeps its routing; mirrored in a Python bool so that
        # forward never reads a device tensor (a host sync per layer on GPU).
        self.register_buffer("use_sparse", torch.zeros((), dtype=torch.bool))
        self._sparse_now = False
        self.register_load_state_dict_post_hook(lambda module, _keys: module.refresh_routing_mirror())
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for w in (self.w_gate, self.w_up, self.w_down):
            nn.init.normal_(w, mean=0.0, std=self.init_std)
        self.set_sparse(False)

    @torch.no_grad()
    def reorder_units(self, order: torch.Tensor) -> None:
        """Store hidden unit order[i] as unit i (rows of w_gate, w_up and w_down alike): the same
        function, units in a new order. Optimizer state is not permuted: for a model done training."""
        if order.shape != (self.d_ff,):
            raise ValueError(
                f"order must be a permutation of the {self.d_ff} units, got shape {tuple(order.shape)}"
            )
        order = order.to(self.w_gate.device)
        for w in (self.w_gate, self.w_up, self.w_down):
            w.copy_(w[order])

    def set_sparse(self, flag: bool) -> None:
        self.use_sparse.fill_(bool(flag))
        self._sparse_now = bool(flag)

    def refresh_routing_mirror(self) -> None:
        """Re-read `use_sparse` after its tensor was written in place (checkpoint load)."""
        if self.use_sparse.device.type != "meta":
            self._sparse_now = bool(self.use_sparse.item())

    def takes_sparse_path(self, x: torch.Tensor) -> bool:
        wants_sparse = self.impl == "twell" or (self.impl == "auto" and self._sparse_now)
        return wants_sparse and kernels_usable(x)

    def forward(self, x: torch.Tensor, with_stats: bool = True, dense: bool = False):
        """x [..., D] -> (y [..., D], l1 0-dim fp32 or None, FFNStats or None).

        l1 = mean over tokens of sum over units of |h|. with_stats=False (inference) skips l1 and
        the statistics, which lets the sparse path use the fused inference kernel. dense=True: the
        dense matmuls whatever the routing (the same function; a generation's prefill, where they are
        faster, model/generate.py).
        """
        if not dense and self.takes_sparse_path(x):
            return self._forward_twell(x, with_stats)
        return self._forward_dense(x, with_stats)

    def _forward_dense(self, x: torch.Tensor, with_stats: bool):
        gate = F.linear(x, self.w_gate)
        h = F.relu(gate) * F.linear(x, self.w_up)
        y = h @ self.w_down
        if not with_stats:
            return y, None, None
        # Sum in fp32 without an fp32 copy of h: abs() reuses the h already saved for the matmul.
        l1 = h.abs().sum(dim=-1, dtype=torch.float32).mean()
        with torch.no_grad():
            active = (gate > 0).reshape(-1, self.d_ff)
            # zeros() fills on the device; a Python 0 would be copied host-to-device (a stream sync).
            stats = _stats_from_row_active(
                active.sum(dim=-1, dtype=torch.int32),
                active.sum(dim=0, dtype=torch.int32),
                torch.zeros((), dtype=torch.int32, device=gate.device),
            )
        return y, l1, stats

    def _forward_twell(self, x: torch.Tensor, with_stats: bool):
        kernels = _import_kernels()
        # The kernels take only dense row-major x; contiguous() is a no-op when x already is.
        x2d = x.reshape(-1, self.d_model).contiguous()
        weights = (self.w_gate, self.w_up, self.w_down)
        if not with_stats and not torch.is_grad_enabled():
            # Custom kernels do not take part in autocast: cast to the autocast dtype by hand.
            device_type = x.device.type
            dtype = (
                torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x2d.dtype
            )
            x2d, weights = x2d.to(dtype), tuple(w.to(dtype) for w in weights)
            y = kernels.twell_ffn_inference(
                x2d, *weights, hot_units=self.hot_units, hot_prefix=self.hot_prefix
            )
            return y.view(*x.shape[:-1], self.d_model), None, None
        # The training op gets the parameters themselves: it casts them under autocast (differentiably,
        # so gradients reach fp32 master weights) and keys the layer's entry-count history by w_gate.
        # A cast copy here would be a new tensor every step: no history, one host sync per layer.
        if not torch.is_autocast_enabled(x.device.type):
            x2d = x2d.to(self.w_gate.dtype)  # outside autocast the weights' dtype decides (as nn.Linear)
        out = kernels.twell_ffn(x2d, *weights, hot_units=self.hot_units)
        y = out.y.view(*x.shape[:-1], self.d_model)
        if not with_stats:
            return y, None, None
        stats = _stats_from_row_active(
            out.row_active.detach(), out.unit_fires.detach(), out.overflow_rows.detach()
        )
        return y, out.l1.float(), stats
