"""Fused TwELL inference FFN: y = sum_j relu(g_j) * (x . w_up[j]) * w_down[j], h never in memory.

Two schedules over the same gate GEMM:

* "row"   - one program per token row walks its TwELL entries on CUDA cores: gather w_up[j] and
            w_down[j] for each active unit (the paper's reference schedule). Overflow tiles (more
            positives than slots) are recomputed densely from x and w_gate inside the program.
* "block" - a block of BLOCK_M rows works on the union of its active units (kernels/union.py): the
            gate epilogue compacts the union per column tile, then tensor-core GEMMs run on the
            gathered weight rows, so each weight row is read once per block instead of once per
            token. Never overflows: a union holds at most the tile's width.
NOTES.md has the arithmetic behind both.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ._common import check_ffn_args, check_kernel_device, interpreting, next_pow2
from .gate import twell_gate

SCHEDULES = ("row", "block")


class InferenceStats(NamedTuple):
    overflow_rows: torch.Tensor  # int32 0-dim: rows that took the overflow path (always 0 for "block")


@triton.jit
def _entries_contribution(
    x,
    slot,
    count,
    row_tile,
    cols_ptr,
    vals_ptr,
    wu_ptr,
    wd_ptr,
    ds,
    d_ok,
    D: tl.constexpr,
    SLOTS: tl.constexpr,
):
    """sum over the given TwELL slots of gate * (x . w_up[unit]) * w_down[unit] (fp32 [BLOCK_D])."""
    slot_ok = slot < count
    entry = row_tile * SLOTS + slot
    units = tl.load(cols_ptr + entry, mask=slot_ok, other=0).to(tl.int64)
    gate = tl.load(vals_ptr + entry, mask=slot_ok, other=0.0).to(tl.float32)
    w_off = units[:, None] * D + ds[None, :]
    live = slot_ok[:, None] & d_ok[None, :]
    wu = tl.load(wu_ptr + w_off, mask=live, other=0.0)
    h = gate * tl.sum(wu.to(tl.float32) * x[None, :], axis=1)
    wd = tl.load(wd_ptr + w_off, mask=live, other=0.0)
    return tl.sum(h[:, None] * wd.to(tl.float32), axis=0)


@triton.jit
def _row_consumer_kernel(
    x_ptr,
    wg_ptr,
    wu_ptr,
    wd_ptr,
    y_ptr,
    counts_ptr,
    cols_ptr,
    vals_ptr,
    F: tl.constexpr,
    T: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TILE_N: tl.constexpr,
    SLOTS: tl.constexpr,
    CHUNK: tl.constexpr,
    DYNAMIC_LOOPS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    ds = tl.arange(0, BLOCK_D)
    d_ok = ds < D
    x = tl.load(x_ptr + row * D + ds, mask=d_ok, other=0.0).to(tl.float32)
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    lanes = tl.arange(0, CHUNK)
    for tile in range(T):
        count = tl.load(counts_ptr + row * T + tile)
        if count > SLOTS:
            # Overflow tile: the slots hold only part of it, so recompute the whole tile from w_gate.
            for c0 in range(0, TILE_N, CHUNK):
                units = tile * TILE_N + c0 + lanes
                unit_ok = units < F
                w_off = units[:, None].to(tl.int64) * D + ds[None, :]
                wg = tl.load(wg_ptr + w_off, mask=unit_ok[:, None] & d_ok[None, :], other=0.0)
                gate = tl.maximum(tl.sum(wg.to(tl.float32) * x[None, :], axis=1), 0.0)
                # Round like the TwELL values so both paths give the same numbers.
                gate = gate.to(vals_ptr.dtype.element_ty).to(tl.float32)
                live = (gate > 0)[:, None] & d_ok[None, :]
                wu = tl.load(wu_ptr + w_off, mask=live, other=0.0)
                h = gate * tl.sum(wu.to(tl.float32) * x[None, :], axis=1)
                wd = tl.load(wd_ptr + w_off, mask=live, other=0.0)
                acc += tl.sum(h[:, None] * wd.to(tl.float32), axis=0)
        else:
            # Loop to the count on GPU; the interpreter cannot loop to a loaded bound, so it masks.
            if DYNAMIC_LOOPS:
                for s0 in range(0, count, CHUNK):
                    acc += _entries_contribution(
                        x,
                        s0 + lanes,
                        count,
                        row * T + tile,
                        cols_ptr,
                        vals_ptr,
                        wu_ptr,
                        wd_ptr,
                        ds,
                        d_ok,
                        D,
                        SLOTS,
                    )
            else:
                for s0 in range(0, SLOTS, CHUNK):
                    acc += _entries_contribution(
                        x,
                        s0 + lanes,
                        count,
                        row * T + tile,
                        cols_ptr,
                        vals_ptr,
                        wu_ptr,
                        wd_ptr,
                        ds,
                        d_ok,
                        D,
                        SLOTS,
                    )
    tl.store(y_ptr + row * D + ds, acc.to(y_ptr.dtype.element_ty), mask=d_ok)


def _row_schedule(x, w_gate, w_up, w_down, slots, tile_n):
    M, D = x.shape
    gate = twell_gate(x, w_gate, slots=slots, tile_n=tile_n)
    y = torch.empty_like(x)
    block_d = next_pow2(D)
    # Entries per step: enough loads in flight, while [CHUNK, D] weight slabs stay in registers.
    chunk = max(2, min(16, 16384 // block_d, gate.slots))
    chunk = min(next_pow2(chunk), gate.tile_n)
    warps = 4 if block_d <= 1024 else 8
    _row_consumer_kernel[(M,)](
        x,
        w_gate,
        w_up,
        w_down,
        y,
        gate.counts,
        gate.cols,
        gate.vals,
        w_gate.shape[0],
        gate.counts.shape[1],
        D=D,
        BLOCK_D=block_d,
        TILE_N=gate.tile_n,
        SLOTS=gate.slots,
        CHUNK=chunk,
        DYNAMIC_LOOPS=not interpreting(),
        num_warps=warps,
    )
    overflow_rows = (gate.counts > gate.slots).any(dim=1).sum(dtype=torch.int32)
    return y, InferenceStats(overflow_rows)


def default_schedule(M: int) -> str:
    """The block schedule unless the interpreter runs (it is exact too, just slower to interpret)."""
    return "row" if interpreting() else "block"


@torch.no_grad()
def twell_ffn_inference(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    *,
    schedule: str | None = None,
    slots: int | None = None,
    tile_n: int | None = None,
    return_stats: bool = False,
):
    """y = (relu(x w_gate^T) * (x w_up^T)) @ w_down with TwELL kernels; no autograd, no host sync.

    schedule: "row" or "block" (None: the faster one for this device). slots / tile_n: TwELL format
    of the row schedule (see kernels.gate). With return_stats=True returns (y, InferenceStats).
    """
    check_ffn_args(x, w_gate, w_up, w_down)
    check_kernel_device(x)
    schedule = default_schedule(x.shape[0]) if schedule is None else schedule
    if schedule == "row":
        y, stats = _row_schedule(x, w_gate, w_up, w_down, slots, tile_n)
    elif schedule == "block":
        from .union import block_schedule

        y, stats = block_schedule(x, w_gate, w_up, w_down, tile_n)
    else:
        raise ValueError(f"schedule={schedule!r} is not one of {SCHEDULES}")
    return (y, stats) if return_stats else y
