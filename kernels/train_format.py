"""The training format: the gate's TwELL tiles compacted into one exact CSR of the activation pattern.

TwELL (kernels/gate.py) holds, per (row, column tile), the true count and up to `slots` entries.
For training we want each row's entries contiguous (row-parallel products) and a flat entry list
(entry-parallel products), so the tiles are compacted into a CSR: row_ptr [M+1], and per entry its
row, column and gate value. Exact by construction: a row with any tile holding more positive gate
values than the slots (an overflow tile, whose extra entries TwELL did not keep) is left out of the
CSR entirely and listed in `overflow_rows`; the training op computes those rows densely. Nothing
is dropped and nothing has a capacity: the CSR is sized from the true counts.

Sizes. Exact (`capacity=None`): one host sync reads the entry and overflow-row counts and the CSR
is sized from them. With a `capacity` (the training op's default after its first call on a layer:
the previous call's count plus a margin) nothing waits: the CSR is sized `capacity`, row_ptr is
clamped to it so no kernel reads or writes past it, and the totals travel to host memory behind
the kernels (`pending`). The caller reads them once it has issued its work and redoes the call
exactly if the entries or the overflow rows (a fixed slot list, `ovf_capacity`) did not fit (a miss
costs one more pass; a wrong result is never returned). The host thus issues the layer while the gate GEMM runs instead of
waiting for it: the step at 16k tokens is host-bound on an H200 (kernels/NOTES_TRAIN.md).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl


class PendingTotals:
    """(entries, overflow rows) of a pattern built with a capacity: copied device -> pinned host memory
    behind the kernels that computed them; read() waits for that copy only (not for later work)."""

    # One pinned pair and one event per device, created once: a pattern is read before the next one is
    # built (the op reads it within its forward), so reuse is safe and costs no allocation per call.
    _host: dict[torch.device, tuple[torch.Tensor, torch.cuda.Event]] = {}

    def __init__(self, totals: torch.Tensor):
        self._event = None
        if totals.is_cuda:
            if totals.device not in self._host:
                pinned = torch.empty(2, dtype=torch.int32, pin_memory=True)
                self._host[totals.device] = (pinned, torch.cuda.Event())
            buf, self._event = self._host[totals.device]
            buf.copy_(totals, non_blocking=True)
            self._event.record()
            totals = buf
        self._totals = totals

    def read(self) -> tuple[int, int]:
        if self._event is not None:
            self._event.synchronize()
        n_ovf, nnz = self._totals.tolist()
        return nnz, n_ovf


class TrainPattern(NamedTuple):
    """The activation pattern of h = relu(x w_gate^T) * (x w_up^T), in CSR form."""

    row_ptr: torch.Tensor  # int32 [M + 1]; overflow rows have empty segments
    rows: torch.Tensor  # int32 [nnz]: row of each entry (row-major order)
    cols: torch.Tensor  # int32 [nnz]: column (hidden unit) of each entry
    gate: torch.Tensor  # [nnz] dtype of x: relu(x w_gate^T) at the entry, > 0
    overflow_rows: torch.Tensor  # int64 [n_ovf]: rows computed densely (a TwELL tile overflowed)
    row_active: torch.Tensor  # int32 [M]: positive gate values per row (overflow rows included)
    totals: torch.Tensor  # int32 [2] on the device: (overflow rows, entries)
    # Built with a capacity: the four entry arrays hold `capacity` slots (the first nnz valid once
    # pending.read() shows nnz <= capacity), overflow_rows `ovf_capacity` (-1 padded); read() gives
    # the true counts (None when static: nothing is read back).
    pending: PendingTotals | None = None


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
    end = tl.load(row_ptr_ptr + row + 1)  # clamped to the capacity when one is given: never write past it
    keep = mask_t[:, None] & (offs_s[None, :] < counts[:, None]) & fits[:, None]
    src = (row * T + offs_t[:, None]).to(tl.int64) * SLOTS + offs_s[None, :]
    dst = base + tile_start[:, None] + offs_s[None, :]
    keep = keep & (dst < end)
    col = tl.load(tw_cols_ptr + src, mask=keep, other=0)
    val = tl.load(tw_vals_ptr + src, mask=keep, other=0.0)
    tl.store(cols_ptr + dst, col.to(tl.int32), mask=keep)
    tl.store(vals_ptr + dst, val, mask=keep)
    tl.store(rows_ptr + dst, tl.zeros([BLOCK_T, BLOCK_S], dtype=tl.int32) + row, mask=keep)


@triton.jit
def _row_scan_kernel(
    counts_ptr, row_active_ptr, row_ptr_ptr, ovf_ptr, totals_ptr, M, T,
    SLOTS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr,
):  # fmt: skip
    """Per row: positives (row_active), overflow flag (a tile holds more than SLOTS) and CSR length
    (0 for overflow rows, into row_ptr[1 + row]); the batch totals (overflow rows, entries) by integer
    atomics (exact, order-free). One launch instead of ~10 torch ops."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok_r = rows < M
    ts = tl.arange(0, BLOCK_T)
    ok = ok_r[:, None] & (ts[None, :] < T)
    c = tl.load(counts_ptr + rows[:, None].to(tl.int64) * T + ts[None, :], mask=ok, other=0)
    active = tl.sum(c, axis=1)
    over = tl.max(c, axis=1) > SLOTS
    nnz = tl.where(over, 0, active)
    tl.store(row_active_ptr + rows, active, mask=ok_r)
    tl.store(row_ptr_ptr + 1 + rows, nnz, mask=ok_r)
    tl.store(ovf_ptr + rows, over.to(tl.int8), mask=ok_r)
    tl.store(row_ptr_ptr + rows, tl.zeros([BLOCK_R], dtype=tl.int32), mask=rows == 0)
    tl.atomic_add(totals_ptr, tl.sum(over.to(tl.int32), axis=0))
    tl.atomic_add(totals_ptr + 1, tl.sum(nnz, axis=0))


def build_pattern(
    counts: torch.Tensor,
    tw_cols: torch.Tensor,
    tw_vals: torch.Tensor,
    slots: int,
    capacity: int | None = None,
    static: bool = False,
    ovf_capacity: int = 0,
    n_cols: int = 0,
) -> TrainPattern:
    """TwELL (counts [M, T], cols/vals [M, T, slots]) -> TrainPattern. Exact sizes with one host sync,
    or `capacity` entry slots and no sync (the counts come back in `pending`; see the module doc).
    `static` (with a capacity; CUDA graph capture): nothing is read back at all (pending None; the
    caller checks the device totals), and the slots past the entries hold row 0, column `n_cols` (past
    the last unit: a column sort puts them last, outside every column) and gate 0 (no contribution;
    their rows are never read).
    `ovf_capacity` (with a capacity): overflow_rows is a fixed list of that many slots, the overflow
    rows in order and then -1."""
    M, T = counts.shape
    device = counts.device
    counts = counts.to(torch.int32).contiguous()
    row_active = torch.empty(M, device=device, dtype=torch.int32)
    row_ptr = torch.empty(M + 1, device=device, dtype=torch.int32)
    overflow = torch.empty(M, device=device, dtype=torch.int8)
    totals = torch.zeros(2, device=device, dtype=torch.int32)
    if M:
        block_t = triton.next_power_of_2(T)
        block_r = max(1, min(128, 4096 // block_t))
        _row_scan_kernel[(triton.cdiv(M, block_r),)](
            counts, row_active, row_ptr, overflow, totals, M, T, SLOTS=slots, BLOCK_R=block_r, BLOCK_T=block_t,
        )  # fmt: skip
    else:
        row_ptr.zero_()
    row_ptr[1:].cumsum_(0)  # in place, int32
    if capacity is not None:
        row_ptr.clamp_(max=capacity)  # rows past the capacity get empty (or cut) segments: a miss
        pending = None if static else PendingTotals(totals)
        nnz, n_ovf = capacity, ovf_capacity  # a fixed overflow list (flagged rows first, then -1)
    else:
        pending = None
        n_ovf, nnz = totals.tolist()

    rows = torch.empty(nnz, device=device, dtype=torch.int32)
    if static:  # unused slots: past the last column, gate 0 (rows never read there)
        cols = torch.full((nnz,), n_cols, device=device, dtype=torch.int32)
        gate = torch.zeros(nnz, device=device, dtype=tw_vals.dtype)
    else:
        cols = torch.empty(nnz, device=device, dtype=torch.int32)
        gate = torch.empty(nnz, device=device, dtype=tw_vals.dtype)
    if nnz:
        _twell_to_csr_kernel[(M,)](
            counts, tw_cols.contiguous(), tw_vals.contiguous(), row_ptr, rows, cols, gate, T,
            SLOTS=slots, BLOCK_T=triton.next_power_of_2(T), BLOCK_S=triton.next_power_of_2(slots),
        )  # fmt: skip
    if n_ovf:  # overflow rows first, in row order, without a second sync (a stable sort of M flags)
        overflow_rows = torch.argsort(overflow, descending=True, stable=True)[:n_ovf]
        if capacity is not None:
            overflow_rows = torch.where(overflow[overflow_rows] > 0, overflow_rows, -1)
    else:  # the common case: no sort, no launches
        overflow_rows = torch.empty(0, dtype=torch.int64, device=device)
    return TrainPattern(row_ptr, rows, cols, gate, overflow_rows, row_active, totals, pending)


@triton.jit
def _permute_kernel(
    order_ptr, rows_ptr, cols_ptr, a_ptr, b_ptr, c_ptr, o_rows_ptr, o_cols_ptr, o_a_ptr, o_b_ptr, o_c_ptr, n,
    BLOCK: tl.constexpr,
):  # fmt: skip
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    src = tl.load(order_ptr + offs, mask=ok, other=0).to(tl.int64)
    tl.store(o_rows_ptr + offs, tl.load(rows_ptr + src, mask=ok, other=0), mask=ok)
    tl.store(o_cols_ptr + offs, tl.load(cols_ptr + src, mask=ok, other=0), mask=ok)
    tl.store(o_a_ptr + offs, tl.load(a_ptr + src, mask=ok, other=0.0), mask=ok)
    tl.store(o_b_ptr + offs, tl.load(b_ptr + src, mask=ok, other=0.0), mask=ok)
    tl.store(o_c_ptr + offs, tl.load(c_ptr + src, mask=ok, other=0.0), mask=ok)


_units_cache: dict[tuple[int, torch.device], torch.Tensor] = {}


def to_csc(
    rows: torch.Tensor,
    cols: torch.Tensor,
    coefs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    n_cols: int,
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Entries regrouped by column: (col_ptr int32 [n_cols + 1], rows by column, the three coefficient
    arrays by column). A stable sort, so each column's rows stay in row order (deterministic column
    sums); column starts by binary search in the sorted columns (no host sync, no atomics); the five
    gathers in one kernel."""
    device, n = cols.device, cols.numel()
    order = torch.argsort(cols, stable=True)
    out_rows, out_cols = torch.empty(2, n, device=device, dtype=rows.dtype).unbind()  # one allocation each
    out = torch.empty(len(coefs), n, device=device, dtype=coefs[0].dtype).unbind()
    if n:
        block = 1024
        _permute_kernel[(triton.cdiv(n, block),)](
            order, rows, cols, *coefs, out_rows, out_cols, *out, n, BLOCK=block, num_warps=4
        )
    key = (n_cols, device)
    units = _units_cache.get(key)
    if units is None:
        units = _units_cache[key] = torch.arange(n_cols + 1, device=device, dtype=torch.int32)
    col_ptr = torch.searchsorted(out_cols, units, out_int32=True)
    return col_ptr, out_rows, out
