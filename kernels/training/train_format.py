"""The training format: the gate's positives as one exact CSR, built straight from the gate GEMM's bitmask.

The gate GEMM (kernels/gate.py, relu_gate_bits) writes h = relu(x w_gate^T) densely plus one int32
word of positive bits per (row, 32 columns). Two small kernels turn that into a CSR of the cold
positives (those not among the hot units, which the op computes densely): a row scan counts each
row's positives from the words (row_ptr, row_active, the batch total), then the compaction walks the
set bits only (a positive's slot = its row's start + the popcounts of the row's earlier words + its
rank in its word) and gathers its gate value from h; hot positives go to g_hot [M, K] instead. For
training we want each row's entries contiguous (row-parallel products) and a flat entry list
(entry-parallel products); both come from this one layout. A row holds as many entries as it has
positives, up to d_ff, so nothing overflows and nothing is dropped: unlike TwELL's fixed slots there
is no overflow path in training at all.

Sizes. Exact (`capacity=None`): one host sync reads the entry count and the CSR is sized from it.
With a `capacity` (the training op's default after its first call on a layer: the previous call's
count plus a margin) nothing waits: the CSR is sized `capacity`, row_ptr is clamped to it so no
kernel reads or writes past it, and the count travels to host memory behind the kernels
(`pending`). The caller reads it once it has issued its work and redoes the call exactly if the
entries did not fit (a miss costs one more pass; a wrong result is never returned). The host thus
issues the layer while the gate GEMM runs instead of waiting for it: the step at 16k tokens is
host-bound on an H200 (docs/KERNELS.md).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .._common import autotune, cdiv, interpreting, next_pow2
from .._launch import fast
from ..bitmask import _popc32, load_bit_words, select_hot_units
from ..gate_compact import _scatter_hot, _zero_rows
from .train_rowfwd import LongRows, empty_long_rows, list_long_rows


class HostCount:
    """An int32 [1] device count copied to pinned host memory behind the kernels that computed it; read()
    waits for that copy only, not for later work (int(count) would wait for everything issued since).
    With no `host` word and event given it takes its own: for a count read long after later ones were
    made (the training op's late sizes). On a CPU the count is final when made: a copy of it is kept."""

    def __init__(self, nnz: torch.Tensor, host: torch.Tensor | None = None, event=None):
        self._event = None
        if nnz.is_cuda:
            if host is None:
                host, event = torch.empty(1, dtype=torch.int32, pin_memory=True), torch.cuda.Event()
            host.copy_(nnz, non_blocking=True)
            event.record()
            self._event, nnz = event, host
        else:
            nnz = nnz.clone()
        self._nnz = nnz

    def read(self) -> int:
        if self._event is not None:
            self._event.synchronize()
        return int(self._nnz[0])


class PendingTotals(HostCount):
    """The entry count of a pattern built with a capacity, in one pinned word and one event per device,
    created once: a pattern is read before the next one is built (the op reads it within its forward),
    so reuse is safe and costs no allocation per call."""

    _host: dict[torch.device, tuple[torch.Tensor, torch.cuda.Event]] = {}

    def __init__(self, nnz: torch.Tensor):
        if nnz.is_cuda and nnz.device not in self._host:
            self._host[nnz.device] = (torch.empty(1, dtype=torch.int32, pin_memory=True), torch.cuda.Event())
        super().__init__(nnz, *self._host.get(nnz.device, (None, None)))


class TrainPattern(NamedTuple):
    """The cold positives of relu(x w_gate^T), in CSR form (row-major, columns ascending per row)."""

    row_ptr: torch.Tensor  # int32 [M + 1]
    rows: torch.Tensor  # int32 [nnz]: row of each entry
    cols: torch.Tensor  # int32 [nnz]: column (hidden unit) of each entry
    gate: torch.Tensor  # [nnz] dtype of h: relu(x w_gate^T) at the entry, > 0
    row_active: torch.Tensor  # int32 [M]: positive gate values per row, hot units included
    totals: torch.Tensor  # int32 [2] on the device: (overflow rows: always 0 in this format, entries)
    # Built with a capacity: the entry arrays hold `capacity` slots (the first nnz valid once
    # pending.read() shows nnz <= capacity); None when exact or static (nothing is read back).
    pending: PendingTotals | None = None
    # The rows with more than LONG_ROW entries by row_ptr (clamped or not, as built), which the row
    # kernels serve first (kernels/training/train_rowfwd.py; with no entries at all the list stays empty).
    long: LongRows | None = None
    # Built `late`: (h, hot_pos or None), where the row kernel reads the positives past the capacity
    past: tuple[torch.Tensor, torch.Tensor | None] | None = None


@triton.jit
def _bits_row_scan_kernel(bits_ptr, hot_bits_ptr, row_ptr_ptr, row_active_ptr, totals_ptr, M, W,
                          HOT: tl.constexpr, ROWS: tl.constexpr, W_PAD: tl.constexpr):  # fmt: skip
    """Per row: all positives (row_active) and cold ones (the CSR length, into row_ptr[1 + row]); the
    batch's entry total by one integer atomic per program (exact, order-free)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    ok = rows < M
    cold, hot = load_bit_words(bits_ptr, hot_bits_ptr, rows, M, W, HOT, ROWS, W_PAD)
    n_cold = tl.sum(_popc32(cold), axis=1)
    tl.store(row_active_ptr + rows, n_cold + tl.sum(_popc32(hot), axis=1), mask=ok)
    tl.store(row_ptr_ptr + 1 + rows, n_cold, mask=ok)
    tl.store(row_ptr_ptr + rows, tl.zeros([ROWS], dtype=tl.int32), mask=rows == 0)
    tl.atomic_add(totals_ptr + 1, tl.sum(n_cold, axis=0))


@triton.jit(do_not_specialize=["cap"])
def _compact_csr_kernel(
    h_ptr, bits_ptr, hot_bits_ptr, hot_pos_ptr, ghot_ptr, row_ptr_ptr, rows_ptr, cols_ptr, vals_ptr, M, F,
    K_HOT, M_BUCKET, cap, long_count_ptr, long_list_ptr, long_slot_ptr, HOT: tl.constexpr, ROWS: tl.constexpr,
    W_PAD: tl.constexpr, DYNAMIC_LOOPS: tl.constexpr, WRITE_ROWS: tl.constexpr, LONG_ROW: tl.constexpr,
    K_PAD: tl.constexpr,
):  # fmt: skip
    """ROWS rows x all W = F / 32 words per program. Never touches a zero of h: positives leave one per
    word and iteration (lowest set bit: column = popcount(lsb - 1)), so the loop runs
    max-popcount-per-word times (a few at 0.5% density, 32 on a dense row: slower, still exact);
    h is read as a 2-byte gather per positive. Slots at or past the row's end or `cap` (the entry
    arrays' size) are not written. M_BUCKET only keys autotuning. Rows with more than LONG_ROW entries
    by row_ptr are appended to the long-row list for the row kernels. HOT: the program's g_hot rows are
    zeroed first (the caller's buffer is uninitialised; no separate fill), then its hot positives land."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    ok = rows < M
    W = F // 32
    if HOT:  # zeros now, the hot positives over them at the end (_scatter_hot)
        _zero_rows(ghot_ptr, rows, ok, K_HOT, ROWS, K_PAD)
    cold, hot = load_bit_words(bits_ptr, hot_bits_ptr, rows, M, W, HOT, ROWS, W_PAD)
    pc = _popc32(cold)
    start = tl.load(row_ptr_ptr + rows, mask=ok, other=0)
    row_end = tl.load(row_ptr_ptr + rows + 1, mask=ok, other=0)
    list_long_rows(rows, ok, start, row_end, long_count_ptr, long_list_ptr, long_slot_ptr, M, LONG_ROW)
    end = tl.minimum(row_end, cap)
    slot = start[:, None] + tl.cumsum(pc, axis=1) - pc  # the row's positives in earlier words
    h_rows = h_ptr + rows[:, None].to(tl.int64) * F
    col0 = tl.arange(0, W_PAD)[None, :] * 32
    row_ids = tl.zeros([ROWS, W_PAD], dtype=tl.int32) + rows[:, None]
    if DYNAMIC_LOOPS:
        for _ in range(0, tl.max(tl.max(pc, axis=1), axis=0)):
            cold, slot = _emit_entries(
                cold, slot, end, col0, h_rows, row_ids, rows_ptr, cols_ptr, vals_ptr, WRITE_ROWS
            )
    else:  # interpreter: constexpr trip count
        for _ in range(0, 32):
            cold, slot = _emit_entries(
                cold, slot, end, col0, h_rows, row_ids, rows_ptr, cols_ptr, vals_ptr, WRITE_ROWS
            )
    if HOT:  # hot positives to their g_hot column, over the zeros stored above
        _scatter_hot(hot, rows, col0, h_rows, hot_pos_ptr, ghot_ptr, K_HOT, DYNAMIC_LOOPS)


@triton.jit
def _emit_entries(
    cold, slot, end, col0, h_rows, row_ids, rows_ptr, cols_ptr, vals_ptr, WRITE_ROWS: tl.constexpr
):
    """Write the lowest positive of every word as entry `slot` (if before the row's end); returns the
    words without it and the next slots."""
    lsb = cold ^ (cold & (cold - 1))
    col = col0 + _popc32(lsb - 1)
    keep = (cold != 0) & (slot < end[:, None])
    v = tl.load(h_rows + col, mask=keep, other=0.0)
    tl.store(cols_ptr + slot, col, mask=keep)
    tl.store(vals_ptr + slot, v, mask=keep)
    if WRITE_ROWS:
        tl.store(rows_ptr + slot, row_ids, mask=keep)
    return cold ^ lsb, slot + 1


# ROWS x W_PAD (256 at d_ff 5632) words per program; the work per word is ~15 ops per iteration. The
# configs of the TwELL compaction this replaced (kernels/gate_compact.py, _compact_bits_kernel).
_tuned_compact_csr = autotune(
    configs=[triton.Config({"ROWS": r}, num_warps=w) for r, w in ((8, 4), (16, 4), (4, 2), (16, 8))],
    key=["M_BUCKET", "F", "HOT"],
    reset_to_zero=["long_count_ptr"],  # each timed run appends the long rows again
)(_compact_csr_kernel)


_BITS_ROW_SCAN = fast(_bits_row_scan_kernel)


_COMPACT_CSR = fast(_tuned_compact_csr)


def hot_split(fires: torch.Tensor, K: int, like: torch.Tensor) -> tuple[torch.Tensor, tuple]:
    """The batch's K most-firing units (select_hot_units on the per-unit positive counts `fires`) as
    build_pattern's `hot` argument: (hot_idx int64 [K], (hot_pos, hot_bits, g_hot)), g_hot an
    uninitialised [M, K] in `like`'s dtype and device (M = like's rows) that the compaction writes whole:
    zeros, then the hot positives."""
    hot_idx, hot_pos, hot_bits = select_hot_units(fires, K)
    g_hot = torch.empty(like.shape[0], K, dtype=like.dtype, device=like.device)
    return hot_idx, (hot_pos, hot_bits, g_hot)


def build_pattern(
    h: torch.Tensor,
    bits: torch.Tensor,
    hot: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    capacity: int | None = None,
    static: bool = False,
    inference: bool = False,
    late: bool = False,
) -> TrainPattern:
    """h [M, F] (relu'd gate values) and its positive bitmask bits int32 [M, F // 32] -> TrainPattern of
    the cold positives. `hot` = (hot_pos int32 [F], hot_bits int32 [F // 32], g_hot [M, K], any contents;
    kernels.bitmask.select_hot_units): g_hot is written whole (the hot positives, zeros elsewhere) and the
    hot positives are left out of the CSR.
    Exact sizes with one host sync, or `capacity` entry slots and no sync (the count comes back in
    `pending`; see the module doc). `static` (with a capacity; CUDA graph capture): nothing is read
    back at all (the caller checks the device totals), and the slots past the entries hold row 0,
    column F (past the last unit: a column sort puts them last, outside every column) and gate 0 (no
    contribution; their rows are never read).
    `inference` (with a capacity; kernels.inference.inference's csr schedule): no host sync and no read-back, no
    entry rows (`rows` is empty), no fill of unused slots, and row_ptr is NOT clamped: entries past the
    capacity are simply not written, and a row whose end lies past it is walked from h by the row
    kernel (kernels/training/train_rowfwd.py): nothing is dropped.
    `late` (with a capacity; the training op's sizes "late"): as `inference`, but the entry rows are
    written (the first `capacity` slots, as training needs them) and `past` holds what the row kernel
    reads the positives past the capacity from. Nothing waits and nothing is read back: the true count
    is row_ptr[M], which the op's backward checks (kernels/training/train.py, SIZES)."""
    M, F = h.shape
    W = F // 32
    device = h.device
    row_active = torch.empty(M, device=device, dtype=torch.int32)
    row_ptr = torch.empty(M + 1, device=device, dtype=torch.int32)
    totals, long_count = torch.zeros(3, device=device, dtype=torch.int32).split((2, 1))  # one memset
    long = empty_long_rows(M, device, long_count)
    hot_pos, hot_bits, g_hot = hot if hot is not None else (bits, bits, h)  # placeholders when not HOT
    w_pad = next_pow2(W)
    if M:
        rows_per = max(1, min(64, 4096 // w_pad))
        _BITS_ROW_SCAN[(cdiv(M, rows_per),)](
            bits, hot_bits, row_ptr, row_active, totals, M, W, HOT=hot is not None, ROWS=rows_per, W_PAD=w_pad,
        )  # fmt: skip
    else:
        row_ptr.zero_()
    row_ptr[1:].cumsum_(0)  # in place, int32
    if inference or late:
        if capacity is None:
            raise ValueError(f"build_pattern({'inference' if inference else 'late'}=True) needs a capacity")
        pending, nnz = None, capacity
    elif capacity is not None:
        row_ptr.clamp_(max=capacity)  # rows past the capacity get empty (or cut) segments: a miss
        pending = None if static else PendingTotals(totals[1:])
        nnz = capacity
    else:
        pending = None
        nnz = int(totals[1])

    rows = torch.empty(0 if inference else nnz, device=device, dtype=torch.int32)
    if static and not inference:  # unused slots: past the last column, gate 0 (rows never read there)
        cols = torch.full((nnz,), F, device=device, dtype=torch.int32)
        gate = torch.zeros(nnz, device=device, dtype=h.dtype)
    else:
        cols = torch.empty(nnz, device=device, dtype=torch.int32)
        gate = torch.empty(nnz, device=device, dtype=h.dtype)
    if M and (nnz or hot is not None):
        args = (
            h, bits, hot_bits, hot_pos, g_hot, row_ptr, rows, cols, gate, M, F,
            g_hot.shape[1] if hot is not None else 1, min(next_pow2(M), 1 << 17), nnz, long.count, long.rows,
            long.slots,
        )  # fmt: skip
        flags = dict(HOT=hot is not None, W_PAD=w_pad, WRITE_ROWS=not inference, LONG_ROW=long.limit)
        flags["K_PAD"] = next_pow2(g_hot.shape[1]) if hot is not None else 1
        if interpreting():
            _compact_csr_kernel[(cdiv(M, 16),)](*args, **flags, DYNAMIC_LOOPS=False, ROWS=16, num_warps=4)
        else:
            _COMPACT_CSR[lambda meta: (cdiv(M, meta["ROWS"]),)](*args, **flags, DYNAMIC_LOOPS=True)
    past = (h, hot_pos if hot is not None else None) if late else None
    return TrainPattern(row_ptr, rows, cols, gate, row_active, totals, pending, long, past)


@triton.jit(do_not_specialize=["n"])
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


_PERMUTE = fast(_permute_kernel)


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
    # 16-bit keys when the columns fit (d_ff < 32767): the radix sort makes two passes instead of four.
    keys = cols.to(torch.int16) if n_cols < torch.iinfo(torch.int16).max else cols
    order = torch.argsort(keys, stable=True)
    out_rows, out_cols = torch.empty(2, n, device=device, dtype=rows.dtype).unbind()  # one allocation each
    out = torch.empty(len(coefs), n, device=device, dtype=coefs[0].dtype).unbind()
    if n:
        block = 1024
        _PERMUTE[(cdiv(n, block),)](
            order, rows, cols, *coefs, out_rows, out_cols, *out, n, BLOCK=block, num_warps=4
        )
    key = (n_cols, device)
    units = _units_cache.get(key)
    if units is None:
        units = _units_cache[key] = torch.arange(n_cols + 1, device=device, dtype=torch.int32)
    col_ptr = torch.searchsorted(out_cols, units, out_int32=True)
    return col_ptr, out_rows, out
