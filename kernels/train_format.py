"""The training format: the gate's TwELL tiles compacted into one exact CSR of the activation pattern.

TwELL (kernels/gate.py) holds, per (row, column tile), the true count and up to `slots` entries.
For training we want each row's entries contiguous (row-parallel products) and a flat entry list
(entry-parallel products), so the tiles are compacted into a CSR: row_ptr [M+1], and per entry its
row, column and gate value. Exact by construction: a row with any tile holding more positive gate
values than the slots (an overflow tile, whose extra entries TwELL did not keep) is left out of the
CSR entirely and listed in `overflow_rows`; the training op computes those rows densely. Nothing
is dropped and nothing has a capacity: the CSR is sized from the true counts.

One host sync per call reads the entry count (to size the CSR exactly, which is what keeps the
saved state small) and the overflow-row count. The gate GEMM dominates the time before it, so the
GPU idles only for the launch latency of the next kernel (~10 us of a ~ms layer).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl


class TrainPattern(NamedTuple):
    """The activation pattern of h = relu(x w_gate^T) * (x w_up^T), in CSR form."""

    row_ptr: torch.Tensor  # int32 [M + 1]; overflow rows have empty segments
    rows: torch.Tensor  # int32 [nnz]: row of each entry (row-major order)
    cols: torch.Tensor  # int32 [nnz]: column (hidden unit) of each entry
    gate: torch.Tensor  # [nnz] dtype of x: relu(x w_gate^T) at the entry, > 0
    overflow_rows: torch.Tensor  # int64 [n_ovf]: rows computed densely (a TwELL tile overflowed)
    row_active: torch.Tensor  # int32 [M]: positive gate values per row (overflow rows included)


@triton.jit
def _twell_to_csr_kernel(
    counts_ptr, tw_cols_ptr, tw_vals_ptr, row_ptr_ptr, rows_ptr, cols_ptr, vals_ptr, T,
    SLOTS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    offs_t = tl.arange(0, BLOCK_T)
    offs_s = tl.arange(0, BLOCK_S)
    mask_t = offs_t < T
    counts = tl.load(counts_ptr + row * T + offs_t, mask=mask_t, other=0)
    # An overflow row is left to the dense path. Broadcast before comparing: a scalar bool combined
    # with a block mask is not a bool mask under newer Triton interpreters.
    fits = (tl.zeros([BLOCK_T], dtype=tl.int32) + tl.max(counts, axis=0)) <= SLOTS
    tile_start = tl.cumsum(counts, axis=0) - counts  # exclusive prefix: where each tile's run begins
    base = tl.load(row_ptr_ptr + row)
    keep = mask_t[:, None] & (offs_s[None, :] < counts[:, None]) & fits[:, None]
    src = (row * T + offs_t[:, None]).to(tl.int64) * SLOTS + offs_s[None, :]
    dst = base + tile_start[:, None] + offs_s[None, :]
    col = tl.load(tw_cols_ptr + src, mask=keep, other=0)
    val = tl.load(tw_vals_ptr + src, mask=keep, other=0.0)
    tl.store(cols_ptr + dst, col.to(tl.int32), mask=keep)
    tl.store(vals_ptr + dst, val, mask=keep)
    tl.store(rows_ptr + dst, tl.zeros([BLOCK_T, BLOCK_S], dtype=tl.int32) + row, mask=keep)


def build_pattern(
    counts: torch.Tensor, tw_cols: torch.Tensor, tw_vals: torch.Tensor, slots: int
) -> TrainPattern:
    """TwELL (counts [M, T], cols/vals [M, T, slots]) -> TrainPattern. One host sync (see module doc)."""
    M, T = counts.shape
    counts = counts.to(torch.int32).contiguous()
    row_active = counts.sum(dim=1, dtype=torch.int32)
    overflow = (counts > slots).any(dim=1)
    row_nnz = torch.where(overflow, 0, row_active)
    row_ptr = torch.zeros(M + 1, device=counts.device, dtype=torch.int32)
    torch.cumsum(row_nnz, dim=0, dtype=torch.int32, out=row_ptr[1:])
    nnz, n_ovf = torch.stack([row_ptr[-1].long(), overflow.sum()]).tolist()

    device = counts.device
    rows = torch.empty(nnz, device=device, dtype=torch.int32)
    cols = torch.empty(nnz, device=device, dtype=torch.int32)
    gate = torch.empty(nnz, device=device, dtype=tw_vals.dtype)
    if nnz:
        _twell_to_csr_kernel[(M,)](
            counts, tw_cols.contiguous(), tw_vals.contiguous(), row_ptr, rows, cols, gate, T,
            SLOTS=slots, BLOCK_T=triton.next_power_of_2(T), BLOCK_S=triton.next_power_of_2(slots),
        )  # fmt: skip
    if n_ovf:  # overflow rows first, in row order, without a second sync (a stable sort of M flags)
        overflow_rows = torch.argsort(overflow.to(torch.int8), descending=True, stable=True)[:n_ovf]
    else:  # the common case: no sort, no launches
        overflow_rows = torch.empty(0, dtype=torch.int64, device=device)
    return TrainPattern(row_ptr, rows, cols, gate, overflow_rows, row_active)
