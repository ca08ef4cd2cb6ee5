"""The training side of activation sparsity: L1 coefficient, activity statistics, dead units.

Everything here stays on the device between log reads: the hot path only adds tensors. The only
collective per optimizer step is one all-reduce of the per-unit fire counts (so every rank sees the
same dead units); the rest is reduced when the trainer reads metrics on the logging cadence.
"""

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils.weak import WeakIdKeyDictionary

from twell.kernels.reinit import MAX_MOMENTS, philox_seed, reinit_rows_
from twell.training.config import SparsityConfig
from twell.training.distributed import all_reduce_


def l1_coef_at(step: int, cfg: SparsityConfig) -> float:
    """The L1 coefficient of the update that follows `step` completed updates.

    0 for the first `l1_warmup_start` steps, then a linear ramp over `l1_warmup_steps` to l1_coef."""
    if step < cfg.l1_warmup_start:
        return 0.0
    if cfg.l1_warmup_steps == 0:
        return cfg.l1_coef
    return cfg.l1_coef * min((step - cfg.l1_warmup_start + 1) / cfg.l1_warmup_steps, 1.0)


class ActivityTracker:
    """Per-layer FFN activity of the model, fed with `out.stats` of every micro-batch.

    Two horizons: the log window (means, maxima, overflow, units that fired at least once, units
    re-initialised) which `read()` reduces over ranks and resets; and per unit the tokens since it
    last fired (all ranks together), which decides which units are dead after each step, and the
    tokens since its gate row was last re-drawn, which spaces re-draws a window apart (`reinit_due`).
    """

    def __init__(self, n_layers: int, d_ff: int, device: torch.device, dead_window_tokens: int):
        self.n_layers, self.d_ff = n_layers, d_ff
        self.dead_window_tokens = dead_window_tokens  # 0: the last optimizer step's tokens
        zeros = lambda dtype, *shape: torch.zeros(*shape, dtype=dtype, device=device)
        self.step_fires = zeros(torch.int32, n_layers, d_ff)
        self.step_tokens = 0  # this rank, this step (a host int: shapes are known on the host)
        self.tokens_since_fire = zeros(torch.int64, n_layers, d_ff)
        self.tokens_since_reinit = zeros(torch.int64, n_layers, d_ff)  # never re-drawn: since the start
        self.dead = zeros(torch.bool, n_layers, d_ff)
        self.window = dead_window_tokens  # the last step's window in tokens
        # log window
        self.active_sum = zeros(torch.float64, n_layers)  # sum over tokens of active units
        self.active_max = zeros(torch.float32, n_layers)
        self.overflow_rows = zeros(torch.int64, n_layers)
        self.fired_in_window = zeros(torch.bool, n_layers, d_ff)
        self.reinit_units = zeros(torch.int64, n_layers)
        self.window_tokens = 0
        # routing window ("auto" FFN impl): mean active units since the last routing check
        self.route_sum = zeros(torch.float64, n_layers)
        self.route_tokens = 0

    def add(self, stats) -> None:
        """One micro-batch's ActivityStats (no host sync)."""
        weighted = stats.active_mean.double() * stats.tokens
        self.active_sum += weighted
        self.route_sum += weighted
        torch.maximum(self.active_max, stats.active_max, out=self.active_max)
        self.overflow_rows += stats.overflow_rows
        self.step_fires += stats.unit_fires
        self.step_tokens += stats.tokens
        self.window_tokens += stats.tokens
        self.route_tokens += stats.tokens

    def end_step(self, world_size: int) -> torch.Tensor:
        """After a step's micro-batches: sum fires over ranks, age the units, return the dead mask."""
        all_reduce_(self.step_fires)
        fired = self.step_fires > 0
        step_tokens = self.step_tokens * world_size  # every rank runs the same number of tokens
        self.tokens_since_fire.add_(step_tokens).masked_fill_(fired, 0)
        self.tokens_since_reinit.add_(step_tokens)
        self.window = self.dead_window_tokens or step_tokens
        torch.ge(self.tokens_since_fire, self.window, out=self.dead)
        self.fired_in_window |= fired
        self.step_fires.zero_()
        self.step_tokens = 0
        return self.dead

    def reinit_due(self) -> torch.Tensor:
        """The dead units whose gate rows are to be re-drawn now, their re-draw clocks restarted: dead, and
        not re-drawn within the last window. A re-drawn unit gets a whole window of tokens to fire before
        it is re-drawn again, so a unit that stays silent is re-drawn once per window whatever the step
        size, as at the paper's step of one window (1M tokens). Without the spacing, 16k-token steps
        re-drew a silent unit at every step once its first window had passed: 64 blends towards noise
        per million tokens instead of one."""
        due = self.dead & (self.tokens_since_reinit >= self.window)
        self.tokens_since_reinit.masked_fill_(due, 0)
        return due

    def route_mean(self) -> torch.Tensor:
        """Mean active units per token per layer since the last call, over all ranks (float32 [L])."""
        totals = all_reduce_(torch.cat([self.route_sum, self.route_sum.new_tensor([self.route_tokens])]))
        self.route_sum.zero_()
        self.route_tokens = 0
        return (totals[:-1] / totals[-1].clamp_min(1)).float()

    def read(self) -> dict:
        """Reduce the log window over ranks, return per-layer Python lists, reset the window."""
        sums = all_reduce_(
            torch.cat(
                [
                    self.active_sum,
                    self.active_sum.new_tensor([self.window_tokens]),
                    self.overflow_rows.double(),
                ]
            )
        )
        # Every rank re-initialises the same rows (of its replica, or of its shard under FSDP2), so
        # the re-init counts are the same on every rank: MAX, not a sum over ranks.
        L = self.n_layers
        maxima = all_reduce_(
            torch.cat([self.active_max.double(), self.reinit_units.double()]),
            op=torch.distributed.ReduceOp.MAX,
        )
        ever = all_reduce_(self.fired_in_window.to(torch.int32), op=torch.distributed.ReduceOp.MAX)
        active_mean = sums[:L] / sums[L].clamp_min(1)
        record = {
            "active_mean": active_mean.tolist(),
            "active_max": maxima[:L].tolist(),
            "active_frac": (active_mean / self.d_ff).tolist(),
            "fired_frac": ever.float().mean(dim=1).tolist(),
            "dead_frac": self.dead.float().mean(dim=1).tolist(),
            "overflow_rows": sums[L + 1 :].long().tolist(),
            "reinit_units": maxima[L:].long().tolist(),
        }
        for t in (
            self.active_sum,
            self.active_max,
            self.overflow_rows,
            self.fired_in_window,
            self.reinit_units,
        ):
            t.zero_()
        self.window_tokens = 0
        return record

    def state_dict(self) -> dict:
        # The dead-unit clocks survive a resume; the log window restarts empty.
        return {
            "tokens_since_fire": self.tokens_since_fire.cpu(),
            "tokens_since_reinit": self.tokens_since_reinit.cpu(),
            "dead": self.dead.cpu(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.tokens_since_fire.copy_(state["tokens_since_fire"])
        # A checkpoint from before the re-draw clock: as if no row had been re-drawn in its last window.
        self.tokens_since_reinit.copy_(state.get("tokens_since_reinit", state["tokens_since_fire"]))
        self.dead.copy_(state["dead"])


def _owned_part(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """The part of `full` (a tensor of param's global shape, or a per-row [d_ff] one where the placement
    shards rows only; the same on every rank) that this rank holds of `param`: all of it for a plain
    tensor; for a DTensor (FSDP2 shards dim 0, the units) the slice its placements give this rank, cut
    locally without communication."""
    if not isinstance(param, DTensor):
        return full
    return distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()


def _local(param: torch.Tensor) -> torch.Tensor:
    """The storage this rank updates in place: the tensor itself, or a DTensor's local shard."""
    return param.to_local() if isinstance(param, DTensor) else param


@torch.no_grad()
def reinit_dead_gate_rows(
    gate_weights: list[nn.Parameter],
    dead: torch.Tensor,
    step: int,
    seed: int,
    lam: float,
    sigma: float,
    optimizer: torch.optim.Optimizer | None = None,
    kernel: bool = False,
) -> torch.Tensor:
    """W_g[j] <- (1 - lam) W_g[j] + lam N(0, sigma^2) for every dead unit j of every layer.

    The noise is a function of (seed, step, layer) and the element's place in the whole [d_ff, d_model]
    matrix, so every data-parallel rank draws the same numbers and the replicas stay identical without a
    broadcast, and a rank that holds a shard of the units (FSDP2: gate weights and AdamW moments are
    DTensors sharded on dim 0) draws exactly its rows' part of the one-process noise. With `optimizer`,
    the AdamW moments of those rows are zeroed too. Returns the number of rows per layer (device).

    kernel (sparsity.reinit_kernel; CUDA, or Triton's interpreter): one Triton kernel per layer that reads
    and writes only the dead rows, its noise Philox from the element's global index (kernels/reinit.py);
    otherwise PyTorch draws the whole matrix from a generator seeded by (seed, step, layer) and blends it
    in where a row is dead (the two draw different numbers from the same seed: a run keeps one or the
    other).
    """
    for layer, (weight, dead_rows) in enumerate(zip(gate_weights, dead)):
        moments = []
        if optimizer is not None:
            moments = [
                m
                for m in optimizer.state.get(weight, {}).values()
                if torch.is_tensor(m) and m.shape == weight.shape
            ]
        if kernel:
            _reinit_layer_kernel(weight, dead_rows, philox_seed(seed, step, layer), lam, sigma, moments)
            continue
        gen = torch.Generator(device=weight.device)
        gen.manual_seed(philox_seed(seed, step, layer))
        noise = torch.randn(weight.shape, generator=gen, device=weight.device, dtype=weight.dtype)
        mask = dead_rows.unsqueeze(1).expand(weight.shape)
        local, local_noise, local_mask = _local(weight), _owned_part(weight, noise), _owned_part(weight, mask)
        local.copy_(torch.where(local_mask, (1.0 - lam) * local + (lam * sigma) * local_noise, local))
        for moment in moments:
            _local(moment).masked_fill_(_owned_part(moment, mask), 0.0)
    return dead.sum(dim=1)


# Per FSDP2-sharded gate weight: the global index of each of this rank's rows, fixed by the placement, so cut
# once (the re-init kernel runs every step, on every layer).
_shard_rows: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _rows_of_shard(weight: DTensor) -> torch.Tensor:
    rows = _shard_rows.get(weight)
    if rows is None:
        if weight.to_local().shape[1] != weight.shape[1]:
            raise ValueError(
                f"the re-init kernel needs whole gate rows on each rank (sharded on dim 0, the units); this "
                f"weight is placed {weight.placements}; set sparsity.reinit_kernel=false"
            )
        index = torch.arange(weight.shape[0], device=weight.to_local().device)
        rows = _shard_rows[weight] = _owned_part(weight, index).contiguous()
    return rows


def _reinit_layer_kernel(weight, dead_rows, stream_seed, lam, sigma, moments) -> None:
    """One layer's re-init through kernels/reinit.py on this rank's rows. A DTensor (FSDP2 shards the units,
    dim 0) takes its rows' flags cut from the [d_ff] flags without communication, and their global indices
    (_rows_of_shard)."""
    rows = None
    if isinstance(weight, DTensor):
        rows = _rows_of_shard(weight)
        dead_rows = _owned_part(weight, dead_rows)
    local_moments = [_local(m) for m in moments]
    reinit_rows_(
        _local(weight),
        dead_rows.contiguous(),
        stream_seed,
        lam,
        sigma,
        tuple(local_moments[:MAX_MOMENTS]),
        rows,
    )
    for moment in local_moments[MAX_MOMENTS:]:
        moment.masked_fill_(dead_rows.unsqueeze(1), 0.0)
