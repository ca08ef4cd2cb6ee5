"""Fused forward of the sparse FFN rows: u at the entries and y = h w_down in one pass per row.

One program per token row walks the row's CSR entries CHUNK at a time and loads whole weight rows
([CHUNK, D]: w_up[unit] and w_down[unit], 4 KB each at D 2048, both issued before any math so their
L2 latencies overlap), the schedule that reached ~4.3 TB/s of gathers in the inference kernel
(kernels/inference/inference.py). Unlike inference it also writes u per entry, which backward needs.

Long rows first. A row's walk is serial, so a row with many entries (the dense first tokens of a
sequence: ~300 cold entries where the mean is ~12) takes ~100 steps while most rows take a few;
launched in row order, the long rows that happen to start last decide when the kernel ends. Rows with
more than LONG_ROW entries are therefore listed (`LongRows`, written by the CSR compaction at no extra
launch, or by `long_rows`) and the grid's first n programs, which start before every other one, take
one listed row each, from the end of the list (the compaction lists rows roughly in row order, so the
rows that would start last go first). Program n + r takes row r unless a long program has it; a list
longer than n (a dense layer) leaves its first rows to their own programs. Each row is still summed
by one program in entry order, so the results are bit for bit those of the plain row-per-program
walk. No loop around the row's walk: one there (a queue of rows) cost the inference kernel ~40
registers a thread and a resident program an SM (scripts/kernel_resources.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .._common import cdiv, interpreting, next_pow2
from .._launch import fast
from .train_sparse import _tuned

LONG_ROW = 64  # a row with more CSR entries than this goes to a long-row program


class LongRows(NamedTuple):
    """The rows of a CSR with more than `limit` entries (by its row_ptr as the row kernels read it)."""

    count: torch.Tensor  # int32 [1]: rows listed
    rows: torch.Tensor  # int32 [max(M, 1)]: the first count[0] entries are the listed rows
    slots: torch.Tensor  # int32 [max(M, 1)]: a listed row's position in `rows` (other rows: unwritten)
    limit: int  # the threshold it was built with, which the row kernels' other programs then apply


@triton.jit
def list_long_rows(rows, ok, start, end, count_ptr, list_ptr, slot_ptr, M, LONG_ROW: tl.constexpr):
    """Append the rows of a [ROWS] block with end - start > LONG_ROW to the list of M slots (one atomic
    per block that has any; the count must start at 0: autotuned callers reset it between timed runs).
    end is the row's row_ptr[row + 1] as the row kernels read it."""
    is_long = ok & (end - start > LONG_ROW)
    li = is_long.to(tl.int32)
    k = tl.sum(li, axis=0)
    if k > 0:
        slot = tl.atomic_add(count_ptr, k) + tl.cumsum(li, axis=0) - li
        keep = is_long & (slot < M)  # always, from a zero count; never a write past the list
        tl.store(list_ptr + slot, rows, mask=keep)
        tl.store(slot_ptr + rows, slot, mask=keep)


@triton.jit
def _long_rows_kernel(
    row_ptr_ptr, count_ptr, list_ptr, slot_ptr, M, LONG_ROW: tl.constexpr, BLOCK: tl.constexpr
):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = rows < M
    start = tl.load(row_ptr_ptr + rows, mask=ok, other=0)
    end = tl.load(row_ptr_ptr + rows + 1, mask=ok, other=0)
    list_long_rows(rows, ok, start, end, count_ptr, list_ptr, slot_ptr, M, LONG_ROW)


_LONG_ROWS = fast(_long_rows_kernel)


def empty_long_rows(M: int, device, count: torch.Tensor | None = None) -> LongRows:
    """An empty list for M rows at the current LONG_ROW; `count` (int32 [1], zero) lets a caller fold
    its memset into another."""
    if count is None:
        count = torch.zeros(1, device=device, dtype=torch.int32)
    rows, slots = torch.empty(2, max(M, 1), device=device, dtype=torch.int32).unbind()
    return LongRows(count, rows, slots, LONG_ROW)


def long_rows(row_ptr: torch.Tensor) -> LongRows:
    """The long rows of a CSR (row_ptr int32 [M + 1]), for callers that built the CSR themselves."""
    M = row_ptr.numel() - 1
    out = empty_long_rows(M, row_ptr.device)
    if M:
        block = 1024
        _LONG_ROWS[(cdiv(M, block),)](
            row_ptr, out.count, out.rows, out.slots, M, LONG_ROW=out.limit, BLOCK=block, num_warps=4
        )
    return out


_long_programs: dict[torch.device, int] = {}
_serve_long_rows = [True]
_NEVER_LONG = 2**31 - 1


def set_long_rows(enabled: bool) -> None:
    """Serve long rows first (the default) or walk every row in row order, one program each
    (benchmarks' A/B; both give the same bits)."""
    _serve_long_rows[0] = bool(enabled)


def long_programs(device: torch.device) -> int:
    """Long-row programs in a row kernel's grid: 4 an SM on a GPU (more than the kernels keep resident,
    ~2-4 an SM: a list up to that long starts at once, the programs without a row exit at once); 2
    under the interpreter (tests see a list longer than that)."""
    if interpreting() or device.type != "cuda":
        return 2
    if device not in _long_programs:
        _long_programs[device] = 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return _long_programs[device]


@triton.jit
def _which_row(row_ptr_ptr, count_ptr, list_ptr, slot_ptr, n_long_progs, LONG_ROW: tl.constexpr):
    """(row, its start, its end, whether this program walks it): program p < n_long_progs takes listed
    row count - 1 - p if there is one; program n_long_progs + r takes row r unless it is listed at a
    position a long program took."""
    pid = tl.program_id(0)
    if pid < n_long_progs:
        n_long = tl.load(count_ptr)
        mine = pid < n_long
        row = tl.load(list_ptr + n_long - 1 - pid, mask=mine, other=0).to(tl.int64)
    else:
        row = (pid - n_long_progs).to(tl.int64)
        mine = pid >= n_long_progs  # true (a tensor, as in the other branch)
    start = tl.load(row_ptr_ptr + row)
    end = tl.load(row_ptr_ptr + row + 1)
    if pid >= n_long_progs:
        if end - start > LONG_ROW:
            mine = tl.load(slot_ptr + row) < tl.load(count_ptr) - n_long_progs
    return row, start, end, mine


@triton.jit
def _row_fwd_step(e0, end, acc, l1, x, cols_ptr, gate_ptr, wu_ptr, wd_ptr, up_ptr, ds, d_ok, D: tl.constexpr,
                  CHUNK: tl.constexpr, STORE_UP: tl.constexpr):  # fmt: skip
    offs = e0 + tl.arange(0, CHUNK)
    ok = offs < end
    units = tl.load(cols_ptr + offs, mask=ok, other=0).to(tl.int64)
    gate = tl.load(gate_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    w_off = units[:, None] * D + ds[None, :]
    live = ok[:, None] & d_ok[None, :]
    wu = tl.load(wu_ptr + w_off, mask=live, other=0.0)
    wd = tl.load(wd_ptr + w_off, mask=live, other=0.0)
    up = tl.sum(wu.to(tl.float32) * x[None, :], axis=1)
    if STORE_UP:
        tl.store(up_ptr + offs, up, mask=ok)
    h = gate * up
    return acc + tl.sum(h[:, None] * wd.to(tl.float32), axis=0), l1 + tl.sum(tl.abs(h), axis=0)


@triton.jit
def _row_past_cap(row, start, cap, acc, l1, x, h_ptr, hot_pos_ptr, wu_ptr, wd_ptr, ds, d_ok, D: tl.constexpr,
                  F: tl.constexpr, HOT: tl.constexpr, CHUNK: tl.constexpr):  # fmt: skip
    """The row's cold positives whose CSR slot (start + rank in the row) is at or past `cap`, the entry
    arrays' size: read straight from the dense h, CHUNK columns at a time (weight rows are loaded for
    those positives only). Rare: only when a batch has more entries than the inference capacity."""
    running = tl.zeros([], dtype=tl.int32)  # the row's cold positives before this chunk
    for c0 in range(0, F, CHUNK):
        cols = c0 + tl.arange(0, CHUNK)
        c_ok = cols < F
        g = tl.load(h_ptr + row * F + cols, mask=c_ok, other=0.0).to(tl.float32)
        cold = (g > 0) & c_ok
        if HOT:
            cold = cold & (tl.load(hot_pos_ptr + cols, mask=c_ok, other=0) < 0)
        ci = cold.to(tl.int32)
        take = cold & (start + running + tl.cumsum(ci, axis=0) - ci >= cap)
        running += tl.sum(ci, axis=0)
        if tl.sum(take.to(tl.int32), axis=0) > 0:  # most chunks hold none: skip their weight tiles
            w_off = cols[:, None].to(tl.int64) * D + ds[None, :]
            live = take[:, None] & d_ok[None, :]
            wu = tl.load(wu_ptr + w_off, mask=live, other=0.0)
            wd = tl.load(wd_ptr + w_off, mask=live, other=0.0)
            hv = tl.where(take, g * tl.sum(wu.to(tl.float32) * x[None, :], axis=1), 0.0)
            acc += tl.sum(hv[:, None] * wd.to(tl.float32), axis=0)
            l1 += tl.sum(tl.abs(hv), axis=0)
    return acc, l1


def _configs():
    # Spill-free at D 2048 on sm_90 (cuobjdump: 143-169 registers); (16, 8) and (8, 4) spill.
    return [triton.Config({"CHUNK": c}, num_warps=w) for c, w in ((8, 8), (4, 8), (4, 4))]


@triton.jit
def _fwd_row(row, start, row_end, cap, cols_ptr, gate_ptr, x_ptr, wu_ptr, wd_ptr, up_ptr, y_ptr, init_ptr,
             l1_ptr, l1_init_ptr, h_ptr, hot_pos_ptr, HAS_L1_INIT: tl.constexpr, D: tl.constexpr,
             BLOCK_D: tl.constexpr, WHILE_LOOP: tl.constexpr, HAS_INIT: tl.constexpr, STORE_UP: tl.constexpr,
             STORE_L1: tl.constexpr, PAST_CAP: tl.constexpr, F: tl.constexpr, HOT: tl.constexpr,
             CHUNK: tl.constexpr):  # fmt: skip
    """One row: y[row] (and l1[row], u at its entries) from its entries [start, min(row_end, cap))."""
    ds = tl.arange(0, BLOCK_D)
    d_ok = ds < D
    x = tl.load(x_ptr + row * D + ds, mask=d_ok, other=0.0).to(tl.float32)
    end = tl.minimum(row_end, cap)  # PAST_CAP: row_ptr is not clamped; entries from cap on are in h only
    if HAS_INIT:  # start from the hot units' dense part of y (one rounding for both parts)
        acc = tl.load(init_ptr + row * D + ds, mask=d_ok, other=0.0).to(tl.float32)
    else:
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    # sum |g u| of the row in fp32 (the L1 term), on top of the hot units' share when given
    l1 = tl.zeros([], dtype=tl.float32)
    if HAS_L1_INIT:
        l1 += tl.load(l1_init_ptr + row)
    if WHILE_LOOP:  # the interpreter cannot run range() to a loaded bound (numpy >= 2)
        e0 = start
        while e0 < end:
            acc, l1 = _row_fwd_step(
                e0, end, acc, l1, x, cols_ptr, gate_ptr, wu_ptr, wd_ptr, up_ptr, ds, d_ok, D, CHUNK, STORE_UP
            )
            e0 += CHUNK
    else:
        for e0 in range(start, end, CHUNK):
            acc, l1 = _row_fwd_step(
                e0, end, acc, l1, x, cols_ptr, gate_ptr, wu_ptr, wd_ptr, up_ptr, ds, d_ok, D, CHUNK, STORE_UP
            )
    if PAST_CAP:
        if row_end > cap:
            acc, l1 = _row_past_cap(
                row, start, cap, acc, l1, x, h_ptr, hot_pos_ptr, wu_ptr, wd_ptr, ds, d_ok, D, F, HOT, CHUNK
            )
    tl.store(y_ptr + row * D + ds, acc.to(y_ptr.dtype.element_ty), mask=d_ok)
    if STORE_L1:
        tl.store(l1_ptr + row, l1)


@triton.jit(do_not_specialize=["cap", "n_long_progs"])
def _row_fwd_kernel(row_ptr_ptr, cols_ptr, gate_ptr, x_ptr, wu_ptr, wd_ptr, up_ptr, y_ptr, init_ptr,
                    l1_ptr, l1_init_ptr, h_ptr, hot_pos_ptr, cap, long_count_ptr, long_list_ptr, long_slot_ptr,
                    n_long_progs,
                    HAS_L1_INIT: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                    WHILE_LOOP: tl.constexpr, HAS_INIT: tl.constexpr, STORE_UP: tl.constexpr,
                    STORE_L1: tl.constexpr, PAST_CAP: tl.constexpr, F: tl.constexpr, HOT: tl.constexpr,
                    LONG_ROW: tl.constexpr, CHUNK: tl.constexpr):  # fmt: skip
    """Grid n_long_progs + M: the first programs take one listed long row each, program n_long_progs + r
    row r unless a long program has it (module doc)."""
    row, start, row_end, mine = _which_row(row_ptr_ptr, long_count_ptr, long_list_ptr, long_slot_ptr, n_long_progs,
                                           LONG_ROW)  # fmt: skip
    if mine:
        _fwd_row(
            row, start, row_end, cap, cols_ptr, gate_ptr, x_ptr, wu_ptr, wd_ptr, up_ptr, y_ptr, init_ptr, l1_ptr,
            l1_init_ptr, h_ptr, hot_pos_ptr, HAS_L1_INIT, D, BLOCK_D, WHILE_LOOP, HAS_INIT, STORE_UP, STORE_L1,
            PAST_CAP, F, HOT, CHUNK,
        )  # fmt: skip


_launch = _tuned(_configs(), key=["D", "STORE_UP"])(_row_fwd_kernel)


def _long(row_ptr: torch.Tensor, given: LongRows | None) -> tuple[tuple[torch.Tensor, ...], int, int]:
    """The row kernels' long-row arguments: (count, rows, slots), programs serving them, the threshold.
    Off (set_long_rows(False)): no long programs and no row over the threshold, so the three are never
    read (row_ptr stands in for them)."""
    if not _serve_long_rows[0]:
        return (row_ptr, row_ptr, row_ptr), 0, _NEVER_LONG
    long = given if given is not None else long_rows(row_ptr)
    return (long.count, long.rows, long.slots), long_programs(row_ptr.device), long.limit


_ROW_FWD = fast(_launch)


def row_ffn_forward(
    row_ptr: torch.Tensor, cols: torch.Tensor, gate: torch.Tensor, x: torch.Tensor, w_up: torch.Tensor,
    w_down: torch.Tensor, init: torch.Tensor | None = None, l1_init: torch.Tensor | None = None,
    long: LongRows | None = None, out: torch.Tensor | None = None,
    past: tuple[torch.Tensor, torch.Tensor | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(u fp32 [nnz] = x[row] . w_up[col] per entry, y [M, D] = init + sum over the row's entries of
    gate * u * w_down[col], l1 fp32 [M] = l1_init + sum over the row's entries of |gate * u|); init
    [M, D] (x's dtype) and l1_init fp32 [M] or None for zeros. All operands contiguous. `long`: the
    CSR's long rows (build_pattern lists them; computed here when None). `out`: y's buffer (like x).
    `past` = (h [M, F], hot_pos or None), for a CSR built late (build_pattern): row_ptr is not clamped
    and a row's positives past the nnz slots count in y and l1 from h (u is stored for the slots only)."""
    M, D = x.shape
    up = torch.empty(cols.numel(), device=x.device, dtype=torch.float32)
    if cols.numel() == 0 and past is None:  # no entry (silent rows, or hot units took every positive)
        if out is None:
            y = init.clone() if init is not None else torch.zeros_like(x)
        else:
            y = out.copy_(init) if init is not None else out.zero_()
        l1 = l1_init.clone() if l1_init is not None else x.new_zeros(M, dtype=torch.float32)
        return up, y, l1
    y = torch.empty_like(x) if out is None else out
    l1 = torch.empty(M, device=x.device, dtype=torch.float32)
    if M == 0:
        return up, y, l1
    long_args, n_long, threshold = _long(row_ptr, long)
    h, hot_pos = past if past is not None else (y, None)
    _ROW_FWD[(n_long + M,)](
        row_ptr, cols, gate, x, w_up, w_down, up, y, init if init is not None else y, l1,
        l1_init if l1_init is not None else l1, h, hot_pos if hot_pos is not None else row_ptr, cols.numel(),
        *long_args, n_long, HAS_L1_INIT=l1_init is not None, D=D, BLOCK_D=next_pow2(D),
        WHILE_LOOP=interpreting(), HAS_INIT=init is not None, STORE_UP=True, STORE_L1=True,
        PAST_CAP=past is not None, F=h.shape[1] if past is not None else 1, HOT=hot_pos is not None,
        LONG_ROW=threshold,
    )  # fmt: skip
    return up, y, l1


def row_ffn_inference(
    row_ptr: torch.Tensor, cols: torch.Tensor, gate: torch.Tensor, x: torch.Tensor, w_up: torch.Tensor,
    w_down: torch.Tensor, h: torch.Tensor, hot_pos: torch.Tensor | None, init: torch.Tensor | None,
    long: LongRows | None = None,
) -> torch.Tensor:  # fmt: skip
    """y [M, D] = init + sum over the row's cold positives of gate * (x . w_up[col]) * w_down[col], from a
    CSR built with build_pattern(..., inference=True): row_ptr unclamped, the first cols.numel() slots
    listed; a row's positives past them are read from h [M, F] (hot_pos int32 [F], >= 0 for the hot
    units that init already holds, or None). No u is stored and no L1 computed. `long` as in
    row_ffn_forward."""
    M, D = x.shape
    y = torch.empty_like(x)
    if M == 0:
        return y
    long_args, n_long, threshold = _long(row_ptr, long)
    _ROW_FWD[(n_long + M,)](
        row_ptr, cols, gate, x, w_up, w_down, y, y, init if init is not None else y, y, y, h,
        hot_pos if hot_pos is not None else row_ptr, cols.numel(), *long_args, n_long,
        HAS_L1_INIT=False, D=D, BLOCK_D=next_pow2(D), WHILE_LOOP=interpreting(), HAS_INIT=init is not None,
        STORE_UP=False, STORE_L1=False, PAST_CAP=True, F=h.shape[1], HOT=hot_pos is not None,
        LONG_ROW=threshold,
    )  # fmt: skip
    return y


@triton.jit
def _dx_row(row, start, end, cols_ptr, dg_ptr, du_ptr, wg_ptr, wu_ptr, dx_ptr, D: tl.constexpr,
            BLOCK_D: tl.constexpr, WHILE_LOOP: tl.constexpr, CHUNK: tl.constexpr):  # fmt: skip
    ds = tl.arange(0, BLOCK_D)
    d_ok = ds < D
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    if WHILE_LOOP:  # the interpreter cannot run range() to a loaded bound (numpy >= 2)
        e0 = start
        while e0 < end:
            acc = _row_dx_step(e0, end, acc, cols_ptr, dg_ptr, du_ptr, wg_ptr, wu_ptr, ds, d_ok, D, CHUNK)
            e0 += CHUNK
    else:
        for e0 in range(start, end, CHUNK):
            acc = _row_dx_step(e0, end, acc, cols_ptr, dg_ptr, du_ptr, wg_ptr, wu_ptr, ds, d_ok, D, CHUNK)
    tl.store(dx_ptr + row * D + ds, acc.to(dx_ptr.dtype.element_ty), mask=d_ok)


@triton.jit(do_not_specialize=["n_long_progs"])
def _row_dx_kernel(row_ptr_ptr, cols_ptr, dg_ptr, du_ptr, wg_ptr, wu_ptr, dx_ptr, long_count_ptr, long_list_ptr,
                   long_slot_ptr, n_long_progs, D: tl.constexpr, BLOCK_D: tl.constexpr, WHILE_LOOP: tl.constexpr,
                   LONG_ROW: tl.constexpr, CHUNK: tl.constexpr):  # fmt: skip
    """dx[row] = sum over the row's entries of d_gate * w_gate[unit] + d_up * w_up[unit]: whole weight
    rows per step, the forward's schedule (one program per row, no D slices re-reading the entries; long
    rows to the grid's first programs, as in _row_fwd_kernel)."""
    row, start, end, mine = _which_row(row_ptr_ptr, long_count_ptr, long_list_ptr, long_slot_ptr, n_long_progs,
                                       LONG_ROW)  # fmt: skip
    if mine:
        _dx_row(
            row, start, end, cols_ptr, dg_ptr, du_ptr, wg_ptr, wu_ptr, dx_ptr, D, BLOCK_D, WHILE_LOOP, CHUNK
        )  # fmt: skip


@triton.jit
def _row_dx_step(e0, end, acc, cols_ptr, dg_ptr, du_ptr, wg_ptr, wu_ptr, ds, d_ok, D: tl.constexpr,
                 CHUNK: tl.constexpr):  # fmt: skip
    offs = e0 + tl.arange(0, CHUNK)
    ok = offs < end
    units = tl.load(cols_ptr + offs, mask=ok, other=0).to(tl.int64)
    dg = tl.load(dg_ptr + offs, mask=ok, other=0.0)
    du = tl.load(du_ptr + offs, mask=ok, other=0.0)
    w_off = units[:, None] * D + ds[None, :]
    live = ok[:, None] & d_ok[None, :]
    wg = tl.load(wg_ptr + w_off, mask=live, other=0.0)
    wu = tl.load(wu_ptr + w_off, mask=live, other=0.0)
    return acc + tl.sum(dg[:, None] * wg.to(tl.float32) + du[:, None] * wu.to(tl.float32), axis=0)


_launch_dx = _tuned(_configs(), key=["D"])(_row_dx_kernel)


_ROW_DX = fast(_launch_dx)


def row_dx(
    row_ptr: torch.Tensor, cols: torch.Tensor, d_gate: torch.Tensor, d_up: torch.Tensor, w_gate: torch.Tensor,
    w_up: torch.Tensor, dx: torch.Tensor, long: LongRows | None = None,
) -> None:  # fmt: skip
    """dx [M, D] (fully written) = per row, sum of d_gate[e] w_gate[cols[e]] + d_up[e] w_up[cols[e]] over
    the row's CSR entries (fp32 coefficients, fp32 accumulation); rows without entries get 0. `long` as
    in row_ffn_forward."""
    M, D = dx.shape
    if M == 0:
        return
    long_args, n_long, threshold = _long(row_ptr, long)
    _ROW_DX[(n_long + M,)](
        row_ptr, cols, d_gate, d_up, w_gate, w_up, dx, *long_args, n_long, D=D,
        BLOCK_D=next_pow2(D), WHILE_LOOP=interpreting(), LONG_ROW=threshold,
    )  # fmt: skip
