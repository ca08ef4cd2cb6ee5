"""Gate GEMM with a sparse TwELL epilogue: relu(x @ w_gate^T) written as per-(row, column tile) lists.

Each program computes a [BLOCK_M, tile_n] tile of the gate pre-activation on tensor cores, applies
ReLU and compacts every row of the tile in registers: a prefix sum over the positive mask gives each
positive value its slot, so the (column, value) entries land in order without atomics, without a dense
h in memory and without a host sync. The count stored is the TRUE count of positives in the
(row, tile); entries past `slots` are not stored and consumers must recompute such overflow tiles.

Mainloop: operands come through TMA tensor descriptors on Hopper and later (no per-element pointer
math or masks in the loop: out-of-range rows of the last block are zero-filled by the hardware), or
through plain pointer loads elsewhere. The grid is either one program per tile or persistent (one
program per SM walking tiles in a grouped, L2-friendly order). scripts/bench_gate.py times each
variant against cuBLAS and against the same mainloop with a dense or no epilogue.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ._common import (
    cdiv,
    check_kernel_device,
    check_x_weight,
    dot_in_fp32,
    dot_precision,
    interpreting,
    next_pow2,
    tma_ready,
)

# What the epilogue writes; only TWELL is API, the others exist to time the mainloop in isolation.
# twell_old: the first epilogue (one cumsum over the whole tile, int64 entry offsets), kept for the bench.
# dense_bits: the dense relu store plus a positive bitmask, one int32 word per (row, 32 columns), written
# to the `counts` argument ([M, F // 32]); the two-kernel path's first pass (see _compact_bits_kernel).
EPI_TWELL, EPI_DENSE, EPI_COUNTS, EPI_TWELL_OLD, EPI_DENSE_BITS = 0, 1, 2, 3, 4
EPILOGUES = {
    "twell": EPI_TWELL,
    "dense": EPI_DENSE,
    "counts": EPI_COUNTS,
    "twell_old": EPI_TWELL_OLD,
    "dense_bits": EPI_DENSE_BITS,
}
# None: the default for the device (see _gate_variant / launch_gate). sub_n: columns per mainloop +
# compaction step inside a format tile; path: "fused" (compaction in the GEMM epilogue) or "two_kernel";
# compact (two_kernel only): "bits" (GEMM writes a positive bitmask, the compaction visits set bits only)
# or "scan" (round-4 kernel: full-width scan of h).
_variant = {
    "loads": None,
    "persistent": None,
    "sub_n": None,
    "path": None,
    "compact": None,
    "bits_gemm": None,
}
DEFAULT_SUB_N = 128  # 128x256 fp32 accumulators + the scan spilled (bench: 20.6 ms vs 4.4 ms dense)


class TwELLGate(NamedTuple):
    counts: torch.Tensor  # int32 [M, T]: true positives per (row, tile); > slots means overflow
    cols: torch.Tensor  # int16/int32 [M, T, S]: absolute column of entry s (valid for s < min(count, S))
    vals: torch.Tensor  # [M, T, S] dtype of x: gate value of entry s
    tile_n: int  # column-tile width; T = ceil(F / tile_n)
    slots: int  # S


@triton.jit
def gate_tile_preact(
    x_ptr,
    w_ptr,
    rows,
    cols,
    M,
    F,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """fp32 [BLOCK_M, BLOCK_N] tile of x @ w^T via pointer loads (x [M, D], w [F, D], row-major;
    D % BLOCK_K == 0). Out-of-range rows/cols are clamped, not masked, so loads stay unpredicated and
    vectorised; their results are garbage the caller must mask. D is constexpr because the
    interpreter cannot loop to a runtime bound inside a nested jit function."""
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    safe_rows = tl.minimum(rows, M - 1)
    safe_cols = tl.minimum(cols, F - 1)
    x_ptrs = x_ptr + safe_rows[:, None].to(tl.int64) * D + ks[None, :]
    w_ptrs = w_ptr + safe_cols[None, :].to(tl.int64) * D + ks[:, None]
    for _ in range(0, D, BLOCK_K):
        a = tl.load(x_ptrs)
        b = tl.load(w_ptrs)
        if DOT_FP32:  # the interpreter's 16-bit tl.dot is wrong; upcast there only
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    return acc


@triton.jit
def _gate_tile_tma(
    x_desc,
    w_desc,
    off_m,
    off_n,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Same tile through TMA descriptors (rows past M / cols past F read as zeros)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, D, BLOCK_K):
        a = x_desc.load([off_m, k])
        b = w_desc.load([off_n, k])
        if DOT_FP32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b.T, acc, input_precision=PRECISION)
    return acc


@triton.jit
def _compact_chunk(
    pre, rows, cols, tile, before, M, F, T, cols_ptr, vals_ptr, SLOTS: tl.constexpr, OFF32: tl.constexpr
):
    """Store the positives of a [R, C] chunk of format tile `tile` at slots before + rank (before: [R]
    positives of the tile's earlier chunks); returns the chunk's [R] positive counts."""
    active = (pre > 0) & (cols[None, :] < F)
    act_i = active.to(tl.int32)
    slot = tl.cumsum(act_i, axis=1) + (before - 1)[:, None]  # rank among the tile's positives
    keep = active & (slot < SLOTS) & (rows < M)[:, None]
    if OFF32:  # M * T * SLOTS < 2^31: one 32-bit offset per element instead of int64 math
        entry = ((rows * T + tile) * SLOTS)[:, None] + slot
    else:
        entry = ((rows.to(tl.int64) * T + tile) * SLOTS)[:, None] + slot
    tl.store(cols_ptr + entry, cols[None, :].to(cols_ptr.dtype.element_ty), mask=keep)
    tl.store(vals_ptr + entry, pre.to(vals_ptr.dtype.element_ty), mask=keep)
    return tl.sum(act_i, axis=1)


@triton.jit
def _bit_or(a, b):
    return a | b


@triton.jit
def _popc32(v):
    """Population count of uint32 lanes (SWAR: ~12 integer ops; runs under the interpreter too)."""
    v = v - ((v >> 1) & 0x55555555)
    v = (v & 0x33333333) + ((v >> 2) & 0x33333333)
    v = (v + (v >> 4)) & 0x0F0F0F0F
    return ((v * 0x01010101) >> 24).to(tl.int32)


@triton.jit
def _twell_epilogue(
    pre,
    rows,
    cols,
    tile,
    M,
    F,
    T,
    counts_ptr,
    cols_ptr,
    vals_ptr,
    dense_ptr,
    SLOTS: tl.constexpr,
    EPILOGUE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """The old single-shot epilogue (EPILOGUE 1/2/3/4: dense, counts, twell_old, dense_bits)."""
    row_ok = rows < M
    if EPILOGUE == 1 or EPILOGUE == 4:  # dense relu store: the cost of a plain GEMM's epilogue
        off = rows[:, None].to(tl.int64) * F + cols[None, :]
        tl.store(
            dense_ptr + off,
            tl.maximum(pre, 0.0).to(dense_ptr.dtype.element_ty),
            mask=row_ok[:, None] & (cols[None, :] < F),
        )
        if EPILOGUE == 4:  # + bit c%32 of word [row, c // 32] set iff pre[row, c] > 0 (counts_ptr: [M, F/32])
            pos = ((pre > 0) & (cols[None, :] < F)).to(tl.uint32)
            lane = tl.arange(0, 32).to(tl.uint32)
            b = tl.reshape(pos, (pre.shape[0], BLOCK_N // 32, 32)) << lane[None, None, :]
            words = tl.reduce(b, 2, _bit_or)
            W = F // 32
            wi = tile * (BLOCK_N // 32) + tl.arange(0, BLOCK_N // 32)
            tl.store(
                counts_ptr + rows[:, None].to(tl.int64) * W + wi[None, :],
                words.to(tl.int32, bitcast=True),
                mask=row_ok[:, None] & (wi < W)[None, :],
            )
    else:
        active = (pre > 0) & (cols[None, :] < F)
        act_i = active.to(tl.int32)
        count = tl.sum(act_i, axis=1)
        tl.store(counts_ptr + rows.to(tl.int64) * T + tile, count, mask=row_ok)
        if EPILOGUE == 3:
            slot = tl.cumsum(act_i, axis=1) - 1  # position of each positive among its row's positives
            keep = active & (slot < SLOTS) & row_ok[:, None]
            row_base = (rows.to(tl.int64) * T + tile) * SLOTS
            entry = row_base[:, None] + slot
            tl.store(cols_ptr + entry, cols[None, :].to(cols_ptr.dtype.element_ty), mask=keep)
            tl.store(vals_ptr + entry, pre.to(vals_ptr.dtype.element_ty), mask=keep)


@triton.jit
def _twell_gate_kernel(
    x_src,
    w_src,
    counts_ptr,
    cols_ptr,
    vals_ptr,
    dense_ptr,
    M,
    F,
    T,
    M_BUCKET,
    zero_ptr,
    n_zero,
    D: tl.constexpr,
    SLOTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SUB_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    TMA: tl.constexpr,
    PERSISTENT: tl.constexpr,
    NUM_PROGS: tl.constexpr,
    EPILOGUE: tl.constexpr,
    OFF32: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
    ZERO_BLOCK: tl.constexpr,
):
    # x_src / w_src are tensor descriptors when TMA, else pointers. M_BUCKET only keys autotuning.
    # BLOCK_N is the format tile; the program walks it in BLOCK_N // SUB_N mainloop + compaction steps.
    if ZERO_BLOCK > 0:  # int32 zero_ptr[:n_zero] (a consumer's per-row counters): no separate fill node
        if tl.program_id(0) == 0:
            zo = tl.arange(0, ZERO_BLOCK)
            tl.store(zero_ptr + zo, tl.zeros([ZERO_BLOCK], dtype=tl.int32), mask=zo < n_zero)
    n_tiles = tl.cdiv(M, BLOCK_M) * T
    if PERSISTENT:  # GPU only: the interpreter cannot loop from a program id
        for tile_id in range(tl.program_id(0), n_tiles, NUM_PROGS):
            _gate_one_tile(
                tile_id, x_src, w_src, counts_ptr, cols_ptr, vals_ptr, dense_ptr, M, F, T, D, SLOTS,
                BLOCK_M, BLOCK_N, SUB_N, BLOCK_K, GROUP_M, TMA, EPILOGUE, OFF32, DOT_FP32, PRECISION,
            )  # fmt: skip
    else:
        _gate_one_tile(
            tl.program_id(0), x_src, w_src, counts_ptr, cols_ptr, vals_ptr, dense_ptr, M, F, T, D, SLOTS,
            BLOCK_M, BLOCK_N, SUB_N, BLOCK_K, GROUP_M, TMA, EPILOGUE, OFF32, DOT_FP32, PRECISION,
        )  # fmt: skip


@triton.jit
def _grouped_tile(tile_id, n_m, n_n, GROUP_M: tl.constexpr):
    """(row block, column tile) of output tile `tile_id` in grouped order: GROUP_M row blocks sweep all
    n_n column tiles together, so the x rows of the group and the weight tiles both stay in L2."""
    per_group = GROUP_M * n_n
    first_m = (tile_id // per_group) * GROUP_M
    size = tl.minimum(n_m - first_m, GROUP_M)
    return first_m + (tile_id % per_group) % size, (tile_id % per_group) // size


@triton.jit
def _gate_one_tile(
    tile_id, x_src, w_src, counts_ptr, cols_ptr, vals_ptr, dense_ptr, M, F, T, D: tl.constexpr,
    SLOTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SUB_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, TMA: tl.constexpr, EPILOGUE: tl.constexpr,
    OFF32: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    pid_m, tile = _grouped_tile(tile_id, tl.cdiv(M, BLOCK_M), T, GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if EPILOGUE == 0:
        # Compaction in SUB_N-column steps: a [BLOCK_M, SUB_N] accumulator leaves registers for the
        # scan and the scattered stores (a whole 128x256 fp32 tile plus the scan spilled); the x tile
        # is re-read from L2 per step. `done` carries each row's positives of the earlier steps.
        done = tl.zeros((BLOCK_M,), dtype=tl.int32)
        for j in tl.static_range(BLOCK_N // SUB_N):
            off_n = tile * BLOCK_N + j * SUB_N
            cols = off_n + tl.arange(0, SUB_N)
            if TMA:
                pre = _gate_tile_tma(
                    x_src, w_src, pid_m * BLOCK_M, off_n, D, BLOCK_M, SUB_N, BLOCK_K, DOT_FP32, PRECISION
                )
            else:
                pre = gate_tile_preact(
                    x_src, w_src, rows, cols, M, F, D, BLOCK_M, SUB_N, BLOCK_K, DOT_FP32, PRECISION
                )
            done += _compact_chunk(pre, rows, cols, tile, done, M, F, T, cols_ptr, vals_ptr, SLOTS, OFF32)
        tl.store(counts_ptr + rows.to(tl.int64) * T + tile, done, mask=rows < M)
    else:
        cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        if TMA:
            pre = _gate_tile_tma(
                x_src, w_src, pid_m * BLOCK_M, tile * BLOCK_N, D, BLOCK_M, BLOCK_N, BLOCK_K, DOT_FP32,
                PRECISION,
            )  # fmt: skip
        else:
            pre = gate_tile_preact(
                x_src, w_src, rows, cols, M, F, D, BLOCK_M, BLOCK_N, BLOCK_K, DOT_FP32, PRECISION
            )
        _twell_epilogue(
            pre,
            rows,
            cols,
            tile,
            M,
            F,
            T,
            counts_ptr,
            cols_ptr,
            vals_ptr,
            dense_ptr,
            SLOTS,
            EPILOGUE,
            BLOCK_N,
        )


@triton.jit
def _compact_dense_kernel(
    h_ptr, counts_ptr, cols_ptr, vals_ptr, hot_pos_ptr, ghot_ptr, M, F, K_HOT, M_BUCKET,
    T: tl.constexpr, T_PAD: tl.constexpr, SLOTS: tl.constexpr, TILE_N: tl.constexpr,
    ROWS: tl.constexpr, OFF32: tl.constexpr, HOT: tl.constexpr,
):  # fmt: skip
    """Second kernel of the two-kernel path: TwELL tiles from a dense relu(x w^T) [M, F].

    One program per ROWS rows walks all T format tiles of those rows: the rows are one contiguous
    ROWS x F block of h (a streaming read in 16-byte vectors, no 512-byte fragments scattered over
    the whole buffer), and the [ROWS, T] counts leave in one 2-D store at the end.
    HOT: columns with hot_pos[c] >= 0 are computed densely by the caller: their values go to
    ghot[row, hot_pos[c]] ([M, K_HOT], every hot column of every row written, zeros included) and they
    are left out of the TwELL entries AND of the counts, so overflow is decided on cold positives only.
    """
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < M
    safe_rows = tl.minimum(rows, M - 1)  # clamped, not masked: the loads stay unpredicated per row
    ts = tl.arange(0, T_PAD)
    counts = tl.zeros((ROWS, T_PAD), dtype=tl.int32)
    h_rows = h_ptr + safe_rows[:, None].to(tl.int64) * F
    for tile in range(T):
        cols = tile * TILE_N + tl.arange(0, TILE_N)
        col_ok = cols < F
        h = tl.load(h_rows + cols[None, :], mask=col_ok[None, :], other=0.0, eviction_policy="evict_first")
        active = h > 0
        if HOT:
            hp = tl.load(hot_pos_ptr + cols, mask=col_ok, other=-1)
            is_hot = hp >= 0
            g_off = rows[:, None].to(tl.int64) * K_HOT + hp[None, :]
            tl.store(
                ghot_ptr + g_off, h.to(ghot_ptr.dtype.element_ty), mask=row_ok[:, None] & is_hot[None, :]
            )
            active = active & (hp < 0)[None, :]
        act_i = active.to(tl.int32)
        slot = tl.cumsum(act_i, axis=1) - 1  # rank among the (cold) positives of the row's tile
        keep = active & (slot < SLOTS) & row_ok[:, None]
        if OFF32:
            entry = ((rows * T + tile) * SLOTS)[:, None] + slot
        else:
            entry = ((rows.to(tl.int64) * T + tile) * SLOTS)[:, None] + slot
        tl.store(cols_ptr + entry, cols[None, :].to(cols_ptr.dtype.element_ty), mask=keep)
        tl.store(vals_ptr + entry, h.to(vals_ptr.dtype.element_ty), mask=keep)
        counts = tl.where(ts[None, :] == tile, tl.sum(act_i, axis=1)[:, None], counts)
    c_off = rows[:, None].to(tl.int64) * T + ts[None, :]
    tl.store(counts_ptr + c_off, counts, mask=row_ok[:, None] & (ts < T)[None, :])


def _compact_configs() -> list[triton.Config]:
    # (ROWS, warps): ROWS x 256 bf16 per tile step; more rows = more bytes in flight per program.
    return [triton.Config({"ROWS": r}, num_warps=w) for r, w in ((16, 4), (32, 8), (8, 4), (32, 4))]


_tuned_compact = triton.autotune(
    configs=_compact_configs(), key=["M_BUCKET", "F", "T", "SLOTS", "TILE_N", "HOT"]
)(_compact_dense_kernel)


def launch_compact(h, counts, cols, vals, tile_n, slots, hot_pos=None, g_hot=None) -> None:
    """TwELL format (counts, cols, vals) from a dense relu buffer h [M, F]; with hot_pos ([F] int32,
    -1 for cold columns) the hot columns go to g_hot [M, K] instead of the entries (see the kernel)."""
    M, F = h.shape
    T = cdiv(F, tile_n)
    hot = hot_pos is not None
    args = (
        h, counts, cols, vals, hot_pos if hot else counts, g_hot if hot else vals, M, F,
        g_hot.shape[1] if hot else 1, min(next_pow2(M), 1 << 17),
    )  # fmt: skip
    common = dict(
        T=T, T_PAD=next_pow2(T), SLOTS=slots, TILE_N=tile_n, OFF32=_off32(M, F, tile_n, slots), HOT=hot
    )
    if interpreting():
        _compact_dense_kernel[(cdiv(M, 16),)](*args, ROWS=16, **common)
        return
    _tuned_compact[lambda meta: (cdiv(M, meta["ROWS"]),)](*args, **common)


@triton.jit
def load_bit_words(bits_ptr, hot_bits_ptr, rows, M, W, HOT: tl.constexpr, ROWS: tl.constexpr,
                   W_PAD: tl.constexpr):  # fmt: skip
    """[ROWS, W_PAD] words of the positive bitmask bits [M, W] (uint32, zeros past M and W) split into
    (cold, hot) positives by the hot columns' word mask hot_bits [W]; hot is 0 without HOT."""
    ws = tl.arange(0, W_PAD)
    ok = (rows < M)[:, None] & (ws < W)[None, :]
    bits = tl.load(bits_ptr + rows[:, None].to(tl.int64) * W + ws[None, :], mask=ok, other=0)
    bits = bits.to(tl.uint32, bitcast=True)
    if HOT:
        hot = bits & tl.load(hot_bits_ptr + ws, mask=ws < W, other=0).to(tl.uint32, bitcast=True)[None, :]
    else:
        hot = tl.zeros([ROWS, W_PAD], dtype=tl.uint32)
    return bits ^ hot, hot


@triton.jit
def _compact_bits_kernel(
    h_ptr, bits_ptr, counts_ptr, cols_ptr, vals_ptr, hot_pos_ptr, hot_bits_ptr, ghot_ptr, M, F, K_HOT,
    M_BUCKET, T: tl.constexpr, T_PAD: tl.constexpr, WPT: tl.constexpr, SLOTS: tl.constexpr,
    ROWS: tl.constexpr, OFF32: tl.constexpr, HOT: tl.constexpr, DYNAMIC_LOOPS: tl.constexpr,
    K_PAD: tl.constexpr,
):  # fmt: skip
    """Second kernel of the two-kernel path, bitmask version: TwELL tiles from h [M, F] and the positive
    bitmask bits [M, F // 32] (int32 words) that the dense_bits GEMM epilogue wrote.

    Never touches a zero of h: per program ROWS rows x all W = F / 32 words (T_PAD tiles of WPT words,
    704 B per row at F 5632 instead of 11 KB of h). Counts = popcounts summed per tile; a positive's slot =
    popcounts of the tile's earlier words + its rank in its word. Positives leave one per word and
    iteration (lowest set bit: its column = popc(lsb - 1)), so the loop runs max-popcount-per-word times
    (a few at 0.5% density) over [ROWS, W] words; only then is h read, a 2-byte gather per positive.
    HOT: hot_bits [W] marks hot columns; their positives go to ghot[row, hot_pos[c]] (the program's ghot
    rows are written whole: zeros, then the positives) and are left out of the entries and counts, as in
    _compact_dense_kernel.
    """
    W_PAD: tl.constexpr = T_PAD * WPT
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < M
    W = F // 32
    if HOT:  # zeros now, the hot positives over them at the end (_scatter_hot)
        _zero_rows(ghot_ptr, rows, row_ok, K_HOT, ROWS, K_PAD)
    ws = tl.arange(0, W_PAD)
    bits, hot = load_bit_words(bits_ptr, hot_bits_ptr, rows, M, W, HOT, ROWS, W_PAD)
    pc = _popc32(bits)
    pc3 = tl.reshape(pc, (ROWS, T_PAD, WPT))
    counts = tl.sum(pc3, axis=2)
    before = tl.reshape(tl.cumsum(pc3, axis=2) - pc3, (ROWS, W_PAD))  # the tile's positives in earlier words
    ts = tl.arange(0, T_PAD)
    c_off = rows[:, None].to(tl.int64) * T + ts[None, :]
    tl.store(counts_ptr + c_off, counts, mask=row_ok[:, None] & (ts < T)[None, :])
    tile_of = ws // WPT
    if OFF32:
        base = (rows[:, None] * T + tile_of[None, :]) * SLOTS + before
    else:
        base = (rows[:, None].to(tl.int64) * T + tile_of[None, :]) * SLOTS + before
    h_rows = h_ptr + rows[:, None].to(tl.int64) * F
    col0 = ws[None, :] * 32
    if DYNAMIC_LOOPS:
        for it in range(0, tl.max(tl.max(pc, axis=1), axis=0)):
            bits = _emit_lowest(bits, it, before, base, col0, h_rows, cols_ptr, vals_ptr, SLOTS)
    else:  # interpreter: constexpr trip count
        for it in range(0, 32):
            bits = _emit_lowest(bits, it, before, base, col0, h_rows, cols_ptr, vals_ptr, SLOTS)
    if HOT:
        _scatter_hot(hot, rows, col0, h_rows, hot_pos_ptr, ghot_ptr, K_HOT, DYNAMIC_LOOPS)


@triton.jit
def _emit_lowest(bits, it, before, base, col0, h_rows, cols_ptr, vals_ptr, SLOTS: tl.constexpr):
    """Store the lowest positive of every word as entry `before + it` of its tile; returns the words
    with that bit cleared."""
    lsb = bits ^ (bits & (bits - 1))
    col = col0 + _popc32(lsb - 1)
    keep = (bits != 0) & (before + it < SLOTS)
    v = tl.load(h_rows + col, mask=keep, other=0.0)
    tl.store(cols_ptr + base + it, col.to(cols_ptr.dtype.element_ty), mask=keep)
    tl.store(vals_ptr + base + it, v.to(vals_ptr.dtype.element_ty), mask=keep)
    return bits ^ lsb


@triton.jit
def _zero_rows(ptr, rows, ok, K, ROWS: tl.constexpr, K_PAD: tl.constexpr):
    """ptr[rows, :K] = 0 for the rows with ok (a [M, K] row-major buffer; K <= K_PAD), in one store: a
    compaction program's g_hot rows, before _scatter_hot (no separate fill of g_hot)."""
    ks = tl.arange(0, K_PAD)
    m = ok[:, None] & (ks < K)[None, :]
    tl.store(
        ptr + rows[:, None].to(tl.int64) * K + ks[None, :],
        tl.zeros([ROWS, K_PAD], ptr.dtype.element_ty),
        mask=m,
    )


@triton.jit
def _scatter_hot(hot, rows, col0, h_rows, hot_pos_ptr, ghot_ptr, K_HOT, DYNAMIC_LOOPS: tl.constexpr):
    """Copy every hot positive (set bits of the words `hot`) from h to its g_hot column, one per word
    and iteration (DYNAMIC_LOOPS: as many iterations as the fullest word needs; else 32), over the zeros
    the program stored in its g_hot rows first (_zero_rows): the barrier orders every thread's zero
    stores before any scatter, so the positives are the later stores."""
    tl.debug_barrier()
    g_rows = ghot_ptr + rows[:, None].to(tl.int64) * K_HOT
    if DYNAMIC_LOOPS:
        for _ in range(0, tl.max(tl.max(_popc32(hot), axis=1), axis=0)):
            hot = _emit_lowest_hot(hot, col0, h_rows, hot_pos_ptr, g_rows)
    else:  # interpreter: constexpr trip count
        for _ in range(0, 32):
            hot = _emit_lowest_hot(hot, col0, h_rows, hot_pos_ptr, g_rows)


@triton.jit
def _emit_lowest_hot(hot, col0, h_rows, hot_pos_ptr, g_rows):
    """Copy the lowest hot positive of every word to its g_hot column; returns the words without it."""
    lsb = hot ^ (hot & (hot - 1))
    col = col0 + _popc32(lsb - 1)
    keep = hot != 0
    v = tl.load(h_rows + col, mask=keep, other=0.0)
    hp = tl.load(hot_pos_ptr + col, mask=keep, other=0)
    tl.store(g_rows + hp, v.to(g_rows.dtype.element_ty), mask=keep)
    return hot ^ lsb


def _compact_bits_configs() -> list[triton.Config]:
    # ROWS x W_PAD (256 at F 5632) words per program; the work per word is ~15 ops x iterations.
    return [triton.Config({"ROWS": r}, num_warps=w) for r, w in ((8, 4), (16, 4), (4, 2), (16, 8))]


_tuned_compact_bits = triton.autotune(
    configs=_compact_bits_configs(), key=["M_BUCKET", "F", "T", "SLOTS", "WPT", "HOT"]
)(_compact_bits_kernel)


def launch_compact_bits(
    h, bits, counts, cols, vals, tile_n, slots, hot_pos=None, g_hot=None, hot_bits=None
) -> None:
    """TwELL format from h [M, F] and its positive bitmask bits [M, F // 32] (the dense_bits epilogue);
    with hot_pos the hot positives go to g_hot [M, K] (written whole: any contents on entry), and
    hot_bits is the hot columns' word mask (select_hot_units writes both)."""
    M, F = h.shape
    T = cdiv(F, tile_n)
    hot = hot_pos is not None
    if hot and (g_hot is None or hot_bits is None):
        raise ValueError("launch_compact_bits: hot_pos needs g_hot and hot_bits (from select_hot_units)")
    args = (
        h, bits, counts, cols, vals, hot_pos if hot else counts, hot_bits if hot else counts,
        g_hot if hot else vals, M, F, g_hot.shape[1] if hot else 1, min(next_pow2(M), 1 << 17),
    )  # fmt: skip
    common = dict(
        T=T,
        T_PAD=next_pow2(T),
        WPT=tile_n // 32,
        SLOTS=slots,
        OFF32=_off32(M, F, tile_n, slots),
        HOT=hot,
        K_PAD=next_pow2(g_hot.shape[1]) if hot else 1,
    )
    if interpreting():
        _compact_bits_kernel[(cdiv(M, 16),)](*args, ROWS=16, DYNAMIC_LOOPS=False, **common)
        return
    _tuned_compact_bits[lambda meta: (cdiv(M, meta["ROWS"]),)](*args, DYNAMIC_LOOPS=True, **common)


def _set_desc_blocks(nargs):
    """Autotune pre-hook: TMA descriptors carry the block shape, which depends on the config."""
    if nargs["TMA"]:
        nargs["x_src"].block_shape = [nargs["BLOCK_M"], nargs["BLOCK_K"]]
        width = nargs["SUB_N"] if nargs["EPILOGUE"] == EPI_TWELL else nargs["BLOCK_N"]
        nargs["w_src"].block_shape = [width, nargs["BLOCK_K"]]


def _configs(regime: str) -> list[triton.Config]:
    # Few configs: each GPU run is short. Hopper wants 128-row tiles and 8 warps for the big GEMM;
    # decode (M <= 64) is a GEMV that lives off bytes in flight: deep pipelines of wide K steps.
    table = {
        "large": [(128, 64, 8, 3), (128, 64, 8, 4), (64, 64, 4, 4)],
        "mid": [(128, 64, 8, 3), (64, 64, 4, 4)],
        "small": [(64, 64, 4, 4), (64, 128, 4, 3)],
        "decode": [(None, 128, 4, 4), (None, 128, 8, 4), (None, 128, 4, 6)],
    }[regime]
    return [
        triton.Config(
            {"BLOCK_K": bk} if bm is None else {"BLOCK_M": bm, "BLOCK_K": bk},
            num_warps=w,
            num_stages=s,
            pre_hook=_set_desc_blocks,
        )
        for bm, bk, w, s in table
    ]


_TUNED: dict[tuple, object] = {}


def _tuned_kernel(regime: str):
    if regime not in _TUNED:
        _TUNED[regime] = triton.autotune(
            configs=_configs(regime),
            key=["M_BUCKET", "F", "D", "BLOCK_N", "SUB_N", "SLOTS", "TMA", "PERSISTENT", "EPILOGUE"],
        )(_twell_gate_kernel)
    return _TUNED[regime]


def _regime(M: int) -> str:
    if M <= 64:
        return "decode"
    return "large" if M >= 2048 else ("mid" if M >= 256 else "small")


def default_tile_n(M: int, F: int) -> int:
    """Format width of twell_gate: 256 (the paper's) for large batches; narrower tiles give small batches
    more programs (32 at M <= 64). The FFN's decode path picks its own format
    (kernels.inference.DECODE_TILE_N: 64-wide tiles measured faster there, NOTES.md round 13)."""
    if interpreting():
        return 64
    if M >= 2048 and F >= 2048:
        return 256
    if M >= 256:
        return 128
    return 64 if M > 64 else 32


def default_slots(tile_n: int) -> int:
    # ~1/8 of the tile: 32 entries at tile_n 256, far above the ~1.3 a typical row puts in a tile.
    return max(8, tile_n // 8)


def set_gate_variant(
    loads: str | None = None,
    persistent: bool | None = None,
    sub_n: int | None = None,
    path: str | None = None,
    compact: str | None = None,
    bits_gemm: str | None = None,
) -> None:
    """Benchmark switch: loads "tma" | "ptr" | None (device default), persistent grid or not, sub_n
    (columns per compaction step inside a format tile: 16-256, None: DEFAULT_SUB_N), path "fused" |
    "two_kernel" | None (device default), compact "bits" | "scan" | None (bits) for the two-kernel path
    and twell_gate_hot, bits_gemm "tiles" | "persistent" | None (the device default): the kernel of the
    dense_bits GEMM (one program per output tile, or launch_relu_bits_persistent)."""
    if loads not in (None, "tma", "ptr"):
        raise ValueError(f"loads={loads!r} must be 'tma', 'ptr' or None")
    if sub_n not in (None, 16, 32, 64, 128, 256):
        raise ValueError(f"sub_n={sub_n!r} must be 16, 32, 64, 128, 256 or None")
    if path not in (None, "fused", "two_kernel"):
        raise ValueError(f"path={path!r} must be 'fused', 'two_kernel' or None")
    if compact not in (None, "bits", "scan"):
        raise ValueError(f"compact={compact!r} must be 'bits', 'scan' or None")
    if bits_gemm not in (None, "tiles", "persistent"):
        raise ValueError(f"bits_gemm={bits_gemm!r} must be 'tiles', 'persistent' or None")
    _variant.update(
        loads=loads, persistent=persistent, sub_n=sub_n, path=path, compact=compact, bits_gemm=bits_gemm
    )


def _gate_variant(x: torch.Tensor) -> tuple[bool, bool]:
    """(TMA loads, persistent grid): TMA needs Hopper+; the interpreter runs the TMA path too (it emulates
    descriptors), so CPU tests cover the production mainloop."""
    loads = _variant["loads"]
    if loads is None:
        tma = interpreting() or torch.cuda.get_device_capability(x.device)[0] >= 9
    else:
        tma = loads == "tma"
    persistent = bool(_variant["persistent"]) and not interpreting()
    return tma, persistent


def launch_gate(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    counts: torch.Tensor,
    cols: torch.Tensor,
    vals: torch.Tensor,
    tile_n: int,
    slots: int,
    *,
    epilogue: str = "twell",
    dense: torch.Tensor | None = None,
    zero: torch.Tensor | None = None,
) -> None:
    """Launch the gate kernel into given buffers (no checks: twell_gate and the benchmarks call this).
    epilogue "twell" takes the path of set_gate_variant: fused, or two_kernel (dense relu into a
    temporary [M, F] buffer, freed on return, then _compact_dense_kernel). `zero`: an int32 tensor
    that must read 0 once the gate is done; the fused kernel zeroes it on the way when it is small
    (decode: no fill node in a graph), otherwise it is filled first."""
    if zero is not None and zero.numel() > 1 << 16:  # one program's store: keep it small
        zero.zero_()
        zero = None
    M = x.shape[0]
    F = w_gate.shape[0]
    # Measured on an H200 (docs/results/bench_gate_round3.txt): the two-kernel path beats the fused
    # epilogue at 16384 (0.85 vs 0.99 ms) and 131072 tokens (6.64 vs 7.74 ms), so it is the GPU
    # default until the fused epilogue reaches mainloop cost; the interpreter keeps the fused one.
    path = _variant["path"] or ("fused" if interpreting() else "two_kernel")
    if epilogue == "twell" and path == "two_kernel" and M > 64:
        if zero is not None:
            zero.zero_()
        h = torch.empty((M, F), dtype=x.dtype, device=x.device)
        bits = _dense_pass(x, w_gate, h, counts, cols, vals, tile_n, slots)
        _compact_pass(h, bits, counts, cols, vals, tile_n, slots)
        del h, bits  # back to the caching allocator at once: the dense pass is transient
        return
    _launch_gemm(x, w_gate, counts, cols, vals, tile_n, slots, epilogue, dense, zero)


def _dense_pass(x, w_gate, h, counts, cols, vals, tile_n, slots):
    """Two-kernel path, first pass: dense relu GEMM into h; with compact "bits" (set_gate_variant, the
    default) it also returns the positive bitmask [M, F // 32] for _compact_bits_kernel, else None."""
    M, F = h.shape
    if (_variant["compact"] or "bits") == "scan":
        _launch_gemm(x, w_gate, counts, cols, vals, tile_n, slots, "dense", h)
        return None
    bits = torch.empty((M, F // 32), dtype=torch.int32, device=h.device)
    if _bits_gemm(x, w_gate, h) == "persistent":
        launch_relu_bits_persistent(x, w_gate, h, bits)
        return bits
    try:
        _launch_gemm(x, w_gate, bits, cols, vals, tile_n, slots, "dense_bits", h)
    except Exception as e:  # a compile failure on a new GPU/Triton: stay correct on the old path
        warnings.warn(
            f"dense_bits gate epilogue failed ({type(e).__name__}: {e}); using compact='scan'", stacklevel=2
        )
        _variant["compact"] = "scan"
        _launch_gemm(x, w_gate, counts, cols, vals, tile_n, slots, "dense", h)
        return None
    return bits


def _bits_gemm(x, w_gate, h) -> str:
    """Which kernel runs the dense_bits GEMM: the persistent one needs TMA (Hopper or later, 16-byte
    aligned bases) and more rows than the decode regime's GEMV."""
    choice = _variant["bits_gemm"] or "persistent"  # measured faster on an H200 (PERSISTENT_CONFIGS)
    if choice == "persistent":
        if not (tma_ready(x, w_gate, h) and x.shape[0] > 64):
            return "tiles"
    return choice


def _compact_pass(
    h, bits, counts, cols, vals, tile_n, slots, hot_pos=None, g_hot=None, hot_bits=None
) -> None:
    if bits is None:
        launch_compact(h, counts, cols, vals, tile_n, slots, hot_pos, g_hot)
        return
    launch_compact_bits(h, bits, counts, cols, vals, tile_n, slots, hot_pos, g_hot, hot_bits)


def _off32(M: int, F: int, tile_n: int, slots: int) -> bool:
    return (M + 256) * cdiv(F, tile_n) * slots < 2**31


def _launch_gemm(x, w_gate, counts, cols, vals, tile_n, slots, epilogue, dense, zero=None) -> None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    M, D = x.shape
    F = w_gate.shape[0]
    T = cdiv(F, tile_n)
    tma, persistent = _gate_variant(x)
    sub_n = min(tile_n, _variant["sub_n"] or DEFAULT_SUB_N)
    if interpreting():
        sub_n = min(tile_n, _variant["sub_n"] or 32)  # CPU tests walk >= 2 steps per tile
    # TMA needs 16-byte aligned bases (a contiguous view may start mid-allocation): else plain loads.
    tma = tma and x.data_ptr() % 16 == 0 and w_gate.data_ptr() % 16 == 0
    if interpreting():
        block_m, block_k = 32, 64
    else:
        block_m, block_k = 128, 64  # placeholders: the autotuner's pre-hook sets the real ones
    regime = _regime(M)
    fixed = {}
    if regime == "decode" or interpreting():
        fixed["BLOCK_M"] = block_m = max(16, next_pow2(M)) if not interpreting() else block_m
    if tma:
        x_src = TensorDescriptor.from_tensor(x, [block_m, block_k])
        w_width = sub_n if epilogue == "twell" else tile_n
        w_src = TensorDescriptor.from_tensor(w_gate, [w_width, block_k])
    else:
        x_src, w_src = x, w_gate
    num_progs = 1
    if persistent:
        num_progs = torch.cuda.get_device_properties(x.device).multi_processor_count
    args = (x_src, w_src, counts, cols, vals, dense if dense is not None else vals, M, F, T)
    n_zero = 0 if zero is None else zero.numel()
    zero_args = (zero if n_zero else counts, n_zero)
    common = dict(
        D=D,
        SLOTS=slots,
        BLOCK_N=tile_n,
        SUB_N=sub_n,
        GROUP_M=8,
        TMA=tma,
        PERSISTENT=persistent,
        NUM_PROGS=num_progs,
        EPILOGUE=EPILOGUES[epilogue],
        OFF32=_off32(M, F, tile_n, slots),
        DOT_FP32=dot_in_fp32(x.dtype),
        PRECISION=dot_precision(x.dtype),
        ZERO_BLOCK=next_pow2(n_zero) if n_zero else 0,
    )
    m_bucket = min(next_pow2(M), 1 << 17)
    if interpreting():
        grid = (cdiv(M, block_m) * T,)
        _twell_gate_kernel[grid](*args, m_bucket, *zero_args, BLOCK_K=block_k, **fixed, **common)
        return

    def grid(meta):
        tiles = cdiv(M, meta["BLOCK_M"]) * T
        return (min(tiles, num_progs),) if persistent else (tiles,)

    _tuned_kernel(regime)[grid](*args, m_bucket, *zero_args, **fixed, **common)


def _format(M: int, F: int, slots: int | None, tile_n: int | None) -> tuple[int, int]:
    tile_n = default_tile_n(M, F) if tile_n is None else int(tile_n)
    if tile_n not in (32, 64, 128, 256):
        raise ValueError(f"tile_n={tile_n} is not supported; use 32, 64, 128 or 256")
    slots = default_slots(tile_n) if slots is None else int(slots)
    if not 1 <= slots <= tile_n:
        raise ValueError(f"slots={slots} must be in [1, tile_n={tile_n}]")
    return tile_n, slots


def _format_buffers(x: torch.Tensor, F: int, tile_n: int, slots: int):
    """Uninitialised (counts, cols, vals) of a TwELL gate of x's rows (the kernels write every entry read)."""
    M, T = x.shape[0], cdiv(F, tile_n)
    col_dtype = torch.int16 if F <= torch.iinfo(torch.int16).max else torch.int32
    counts = torch.empty((M, T), dtype=torch.int32, device=x.device)
    cols = torch.empty((M, T, slots), dtype=col_dtype, device=x.device)
    vals = torch.empty((M, T, slots), dtype=x.dtype, device=x.device)
    return counts, cols, vals


def twell_gate(
    x: torch.Tensor, w_gate: torch.Tensor, *, slots: int | None = None, tile_n: int | None = None
) -> TwELLGate:
    """relu(x @ w_gate^T) in TwELL form (see TwELLGate); counts may exceed slots (overflow tiles)."""
    check_x_weight(x, w_gate, "w_gate")
    check_kernel_device(x)
    return _twell_gate(x, w_gate, slots, tile_n)


def _twell_gate(x, w_gate, slots, tile_n, zero=None) -> TwELLGate:
    """twell_gate after its checks; `zero` see launch_gate."""
    M, F = x.shape[0], w_gate.shape[0]
    tile_n, slots = _format(M, F, slots, tile_n)
    counts, cols, vals = _format_buffers(x, F, tile_n, slots)
    launch_gate(x, w_gate, counts, cols, vals, tile_n, slots, zero=zero)
    return TwELLGate(counts, cols, vals, tile_n, slots)


# ---- The dense_bits GEMM as a persistent kernel -------------------------------------------------
# One program per SM walks output tiles in grouped order; the tile loop is flattened into the K loop
# (tl.range(flatten=True)) so the software pipeliner prefetches the next tile's operands while this
# tile's epilogue runs, and h leaves through TMA stores (asynchronous, from shared memory) in two
# column halves. The epilogue is the dense_bits one: relu(x w^T) to h and one int32 word of positive
# bits per (row, 32 columns). Measured against the tile-per-program kernel in scripts/bench_gate.py.


@triton.jit
def _relu_bits_store(acc, h_desc, bits_ptr, pid_m, pid_n, M, W, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     SPLIT_STORE: tl.constexpr):  # fmt: skip
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    pos = (acc > 0).to(tl.uint32)
    lane = tl.arange(0, 32).to(tl.uint32)
    words = tl.reduce(tl.reshape(pos, (BLOCK_M, BLOCK_N // 32, 32)) << lane[None, None, :], 2, _bit_or)
    rows = off_m + tl.arange(0, BLOCK_M)
    wi = pid_n * (BLOCK_N // 32) + tl.arange(0, BLOCK_N // 32)
    tl.store(
        bits_ptr + rows[:, None].to(tl.int64) * W + wi[None, :],
        words.to(tl.int32, bitcast=True),
        mask=(rows < M)[:, None] & (wi < W)[None, :],
    )
    h = tl.maximum(acc, 0.0).to(h_desc.dtype)
    if SPLIT_STORE:  # two [BLOCK_M, BLOCK_N / 2] stores: half the staging buffer in shared memory
        h0, h1 = tl.split(tl.permute(tl.reshape(h, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
        h_desc.store([off_m, off_n], h0)
        h_desc.store([off_m, off_n + BLOCK_N // 2], h1)
    else:
        h_desc.store([off_m, off_n], h)


@triton.jit
def _relu_bits_persistent_kernel(
    x_desc, w_desc, h_desc, bits_ptr, M, F, M_BUCKET, D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, NUM_PROGS: tl.constexpr,
    SPLIT_STORE: tl.constexpr, FLATTEN: tl.constexpr, WARP_SPEC: tl.constexpr, WHILE_LOOP: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """h = relu(x @ w^T) [M, F] and its positive bitmask [M, F // 32]; x [M, D] and w [F, D] through
    TMA descriptors (out-of-range rows, columns and K read as zeros; out-of-range stores are dropped).
    M_BUCKET only keys autotuning. WHILE_LOOP: the interpreter's form of the tile loop."""
    n_m = tl.cdiv(M, BLOCK_M)
    n_n = tl.cdiv(F, BLOCK_N)
    n_tiles = n_m * n_n
    W = F // 32
    if WHILE_LOOP:
        tile_id = tl.program_id(0)
        while tile_id < n_tiles:
            pid_m, pid_n = _grouped_tile(tile_id, n_m, n_n, GROUP_M)
            acc = _gate_tile_tma(x_desc, w_desc, pid_m * BLOCK_M, pid_n * BLOCK_N, D, BLOCK_M, BLOCK_N, BLOCK_K,
                                 DOT_FP32, PRECISION)  # fmt: skip
            _relu_bits_store(acc, h_desc, bits_ptr, pid_m, pid_n, M, W, BLOCK_M, BLOCK_N, SPLIT_STORE)
            tile_id += NUM_PROGS
    else:
        # The epilogue's tile id advances on its own counter (as in Triton's persistent matmul): with
        # a flattened loop the pipeliner may run the next tile's loads before this epilogue.
        tile_c = tl.program_id(0) - NUM_PROGS
        for tile_id in tl.range(
            tl.program_id(0), n_tiles, NUM_PROGS, flatten=FLATTEN, warp_specialize=WARP_SPEC
        ):
            pid_m, pid_n = _grouped_tile(tile_id, n_m, n_n, GROUP_M)
            acc = _gate_tile_tma(x_desc, w_desc, pid_m * BLOCK_M, pid_n * BLOCK_N, D, BLOCK_M, BLOCK_N, BLOCK_K,
                                 DOT_FP32, PRECISION)  # fmt: skip
            tile_c += NUM_PROGS
            pid_m, pid_n = _grouped_tile(tile_c, n_m, n_n, GROUP_M)
            _relu_bits_store(acc, h_desc, bits_ptr, pid_m, pid_n, M, W, BLOCK_M, BLOCK_N, SPLIT_STORE)


def _persistent_set_blocks(nargs):
    """Autotune pre-hook: the descriptors carry the config's block shapes."""
    bm, bn, bk = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["BLOCK_K"]
    nargs["x_desc"].block_shape = [bm, bk]
    nargs["w_desc"].block_shape = [bn, bk]
    nargs["h_desc"].block_shape = [bm, bn // 2 if nargs["SPLIT_STORE"] else bn]


# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, split store, flatten, warp specialize): the best three of
# the bench_gate.py --bits-gemm sweep on an H200 (docs/results/bench_bits_gemm_round10.txt; 16384 x
# 2048 x 5632: 0.551 / 0.530 / 0.533 ms against 0.599 for the tile-per-program kernel and 0.490 for
# cuBLAS without any epilogue; 131072: 4.466 / 4.600 / 5.100 against 4.818 and 4.356). Four stages of
# 128x256x64 do not fit in shared memory next to the store buffer; warp specialization gained nothing.
PERSISTENT_CONFIGS = [
    (128, 256, 64, 8, 3, True, True, False),
    (128, 256, 64, 8, 3, True, False, False),
    (128, 128, 64, 8, 5, True, True, False),
]
_persistent_tuned: dict = {}


def _persistent_config(cfg) -> triton.Config:
    bm, bn, bk, warps, stages, split, flatten, ws = cfg
    meta = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_STORE=split, FLATTEN=flatten, WARP_SPEC=ws)
    return triton.Config(meta, num_warps=warps, num_stages=stages, pre_hook=_persistent_set_blocks)


def launch_relu_bits_persistent(x, w, h, bits, config=None) -> None:
    """relu(x @ w^T) into h [M, F] and its bitmask into bits [M, F // 32] with the persistent kernel;
    `config`: one PERSISTENT_CONFIGS tuple (the benchmark's sweep) instead of autotuning."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    M, D = x.shape
    F = w.shape[0]
    if interpreting():
        bm, bn, bk = 32, 64, 64
        descs = (
            TensorDescriptor.from_tensor(t, blk)
            for t, blk in ((x, [bm, bk]), (w, [bn, bk]), (h, [bm, bn // 2]))
        )
        n_progs = 3  # fewer programs than tiles: every program walks several
        _relu_bits_persistent_kernel[(n_progs,)](
            *descs, bits, M, F, 0, D=D, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=4, NUM_PROGS=n_progs,
            SPLIT_STORE=True, FLATTEN=False, WARP_SPEC=False, WHILE_LOOP=True, DOT_FP32=dot_in_fp32(x.dtype),
            PRECISION=dot_precision(x.dtype),
        )  # fmt: skip
        return
    n_sm = torch.cuda.get_device_properties(x.device).multi_processor_count
    descs = [TensorDescriptor.from_tensor(t, [64, 64]) for t in (x, w, h)]  # blocks set per config
    common = dict(
        D=D, GROUP_M=8, NUM_PROGS=n_sm, WHILE_LOOP=False, DOT_FP32=False, PRECISION=dot_precision(x.dtype)
    )

    def grid(meta):
        return (min(n_sm, cdiv(M, meta["BLOCK_M"]) * cdiv(F, meta["BLOCK_N"])),)

    if config is not None:
        cfg = _persistent_config(config)
        cfg.pre_hook({**cfg.kwargs, "x_desc": descs[0], "w_desc": descs[1], "h_desc": descs[2]})
        _relu_bits_persistent_kernel[grid({**cfg.kwargs})](
            *descs, bits, M, F, 0, **common, **cfg.kwargs, num_warps=cfg.num_warps, num_stages=cfg.num_stages
        )
        return
    if "k" not in _persistent_tuned:
        _persistent_tuned["k"] = triton.autotune(
            configs=[_persistent_config(c) for c in PERSISTENT_CONFIGS], key=["M_BUCKET", "F", "D"]
        )(_relu_bits_persistent_kernel)
    _persistent_tuned["k"][grid](*descs, bits, M, F, min(next_pow2(M), 1 << 17), **common)


def pack_positive_bits(h: torch.Tensor) -> torch.Tensor:
    """int32 [M, F // 32]: bit c % 32 of word [row, c // 32] set iff h[row, c] > 0 (the dense_bits
    epilogue's bitmask, built with torch ops: the fallback when that epilogue cannot compile)."""
    M, F = h.shape
    lanes = torch.arange(32, device=h.device, dtype=torch.int64)
    words = ((h > 0).view(M, F // 32, 32).to(torch.int64) << lanes).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def relu_gate_bits(x: torch.Tensor, w_gate: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(h = relu(x @ w_gate^T) [M, F] in x's dtype, its positive bitmask int32 [M, F // 32]) from one
    GEMM (the dense_bits epilogue): the first pass of the training op's gate (kernels/train_format.py
    compacts it into a CSR). F must be a multiple of 32."""
    check_x_weight(x, w_gate, "w_gate")
    check_kernel_device(x)
    M, F = x.shape[0], w_gate.shape[0]
    if F % 32:
        raise ValueError(f"d_ff={F} must be a multiple of 32 for the gate's bitmask")
    tile_n, slots = _format(M, F, None, None)
    h = torch.empty((M, F), dtype=x.dtype, device=x.device)
    bits = _dense_pass(x, w_gate, h, h, h, h, tile_n, slots)  # counts/cols/vals: unused by these epilogues
    return h, pack_positive_bits(h) if bits is None else bits


# Rows summed in bit-sliced form before the per-column counts are extracted: 5 bit planes hold 0..31.
_FIRE_GROUP = 31


@triton.jit
def _count_fires_kernel(bits_ptr, fires_ptr, M, W, ROWS: tl.constexpr, WB: tl.constexpr, GROUP: tl.constexpr):
    """fires[c] += positives of column c over this program's ROWS rows, from the positive bitmask
    bits [M, W] (W = F / 32 int32 words, bit c % 32 of word c // 32) that the dense_bits epilogue wrote.

    Bit-sliced: per word, GROUP (<= 31) rows are added into five bit planes (a ripple of ANDs and XORs:
    bit b of planes 0-4 is column b's count in binary), ~10 logic operations a word instead of 32
    shift-mask-adds; the 32 counts are extracted once per group. ROWS is a multiple of GROUP. One atomic
    per column per program."""
    tl.static_assert(GROUP <= 31, "five bit planes count to 31")
    r0 = tl.program_id(0) * ROWS
    ws = tl.program_id(1) * WB + tl.arange(0, WB)
    w_ok = ws < W
    lanes = tl.arange(0, 32).to(tl.uint32)
    acc = tl.zeros((WB, 32), dtype=tl.int32)
    for g0 in range(0, ROWS, GROUP):
        p0 = tl.zeros((WB,), dtype=tl.uint32)
        p1 = tl.zeros((WB,), dtype=tl.uint32)
        p2 = tl.zeros((WB,), dtype=tl.uint32)
        p3 = tl.zeros((WB,), dtype=tl.uint32)
        p4 = tl.zeros((WB,), dtype=tl.uint32)
        for j in tl.static_range(GROUP):  # unrolled: the group's row loads are independent, issued together
            row = r0 + g0 + j
            # ws < W on rows below M, nothing past it (a block compare: Triton 3.9's interpreter mistypes a
            # scalar i1 broadcast into `w_ok & (row < M)`)
            ok = ws < tl.where(row < M, W, 0)
            w = tl.load(bits_ptr + row.to(tl.int64) * W + ws, mask=ok, other=0).to(tl.uint32, bitcast=True)
            carry = p0 & w
            p0 = p0 ^ w
            w = p1 & carry
            p1 = p1 ^ carry
            carry = p2 & w
            p2 = p2 ^ w
            w = p3 & carry
            p3 = p3 ^ carry
            p4 = p4 ^ w  # no carry out: at most 31 rows a group
        counts = (p0[:, None] >> lanes[None, :]) & 1
        counts += ((p1[:, None] >> lanes[None, :]) & 1) << 1
        counts += ((p2[:, None] >> lanes[None, :]) & 1) << 2
        counts += ((p3[:, None] >> lanes[None, :]) & 1) << 3
        counts += ((p4[:, None] >> lanes[None, :]) & 1) << 4
        acc += counts.to(tl.int32)
    cols = ws[:, None] * 32 + tl.arange(0, 32)[None, :]
    tl.atomic_add(fires_ptr + cols, acc, mask=w_ok[:, None], sem="relaxed")


def count_fires(bits: torch.Tensor) -> torch.Tensor:
    """int32 [F]: positives per column of the bitmask bits [M, F // 32]."""
    M, W = bits.shape
    fires = torch.zeros(W * 32, dtype=torch.int32, device=bits.device)
    wb = 8 if interpreting() else 64
    # Rows per program: whole groups of 31, ~512 programs in all (enough to stream the words at HBM
    # speed), but no more than 32 groups (the loop over groups is sequential).
    groups = 2 if interpreting() else max(1, min(32, cdiv(cdiv(M, _FIRE_GROUP) * cdiv(W, wb), 512)))
    rows = _FIRE_GROUP * groups
    _count_fires_kernel[(cdiv(M, rows), cdiv(W, wb))](
        bits, fires, M, W, ROWS=rows, WB=wb, GROUP=_FIRE_GROUP, num_warps=2
    )
    return fires


@triton.jit
def _select_hot_kernel(fires_ptr, hot_idx_ptr, hot_pos_ptr, hot_bits_ptr, F, K, BLOCK_F: tl.constexpr):
    """One program: the K units with the most positives (ties broken by lower column), in column order.

    A binary search for the K-th largest count v (the largest v with at least K counts >= v), then every
    unit above v and the first K - (units above v) units equal to v. Writes hot_idx [K] (int64,
    ascending), hot_pos [F] (rank in hot_idx, -1 if cold) and hot_bits [F / 32] (bit c % 32 of word
    c // 32 set iff c is hot, for the bitmask compaction). No host sync; replaces a row sample +
    torch.topk + sort + mask building (~25 small kernels, ~0.25 ms on an H200 at any batch size)."""
    offs = tl.arange(0, BLOCK_F)
    ok = offs < F
    c = tl.load(fires_ptr + offs, mask=ok, other=-1)
    lo = tl.min(tl.where(ok, c, 2147483647), axis=0)  # at least K >= 1 units are >= the minimum
    hi = tl.max(c, axis=0) + 1  # no unit is >= max + 1
    while hi - lo > 1:  # invariant: count(c >= lo) >= K > count(c >= hi)
        mid = lo + (hi - lo) // 2
        if tl.sum((c >= mid).to(tl.int32), axis=0) >= K:
            lo = mid
        else:
            hi = mid
    above = ok & (c > lo)
    ties = ok & (c == lo)
    need = K - tl.sum(above.to(tl.int32), axis=0)
    take = above | (ties & (tl.cumsum(ties.to(tl.int32), axis=0) <= need))
    rank = tl.cumsum(take.to(tl.int32), axis=0) - 1
    tl.store(hot_pos_ptr + offs, tl.where(take, rank, -1), mask=ok)
    tl.store(hot_idx_ptr + rank, offs.to(tl.int64), mask=take)
    lanes = tl.arange(0, 32).to(tl.uint32)
    shifted = tl.reshape(take.to(tl.uint32), (BLOCK_F // 32, 32)) << lanes[None, :]
    words = tl.reduce(shifted, 1, _bit_or)
    ws = tl.arange(0, BLOCK_F // 32)
    tl.store(hot_bits_ptr + ws, words.to(tl.int32, bitcast=True), mask=ws < (F + 31) // 32)


def select_hot_units(fires: torch.Tensor, K: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hot_idx int64 [K] ascending, hot_pos int32 [F], hot_bits int32 [ceil(F / 32)]) of the K largest
    counts in fires (int32 [F]); see _select_hot_kernel."""
    F = fires.shape[0]
    hot_idx = torch.empty(K, dtype=torch.int64, device=fires.device)
    hot_pos = torch.empty(F, dtype=torch.int32, device=fires.device)
    hot_bits = torch.empty(cdiv(F, 32), dtype=torch.int32, device=fires.device)
    block_f = max(32, next_pow2(F))
    warps = 4 if interpreting() else min(16, max(4, block_f // 1024))
    _select_hot_kernel[(1,)](fires, hot_idx, hot_pos, hot_bits, F, K, BLOCK_F=block_f, num_warps=warps)
    return hot_idx, hot_pos, hot_bits


class HotGate(NamedTuple):
    gate: TwELLGate  # the cold part: entries and counts of non-hot columns only
    hot_idx: torch.Tensor  # int64 [K] sorted hot columns
    hot_pos: torch.Tensor  # int32 [F]: position of column c in hot_idx, -1 if cold
    g_hot: torch.Tensor  # [M, K] dtype of x: relu gate values of the hot columns (zeros included)
    fires: torch.Tensor  # int32 [F]: positives of every unit over the batch (hot and cold, all rows)


def twell_gate_hot(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    hot_units: int,
    *,
    slots: int | None = None,
    tile_n: int | None = None,
) -> HotGate:
    """Gate for the hot-unit split: dense relu pass, each unit's positives over the batch counted
    exactly from the pass's bitmask, the hot_units most frequent units (one selection kernel, no
    host sync), then one compaction pass that writes the hot columns densely to g_hot and the cold ones
    in TwELL form (counts = cold positives only). Any hot set gives exact results; the counts only
    decide which units are worth tensor cores."""
    check_x_weight(x, w_gate, "w_gate")
    check_kernel_device(x)
    M, D = x.shape
    F = w_gate.shape[0]
    K = int(hot_units)
    if not 1 <= K <= F:
        raise ValueError(f"hot_units={K} must be in [1, d_ff={F}]")
    tile_n, slots = _format(M, F, slots, tile_n)
    counts, cols, vals = _format_buffers(x, F, tile_n, slots)
    h = torch.empty((M, F), dtype=x.dtype, device=x.device)
    bits = _dense_pass(x, w_gate, h, counts, cols, vals, tile_n, slots)
    # Exact per-unit counts of the batch: from the bitmask (1/16 of h's bytes), or from h on the scan path.
    fires = count_fires(bits) if bits is not None else (h > 0).sum(0, dtype=torch.int32)
    hot_idx, hot_pos, hot_bits = select_hot_units(fires, K)
    g_hot = torch.empty((M, K), dtype=x.dtype, device=x.device)
    _compact_pass(h, bits, counts, cols, vals, tile_n, slots, hot_pos, g_hot, hot_bits)
    del h, bits
    return HotGate(TwELLGate(counts, cols, vals, tile_n, slots), hot_idx, hot_pos, g_hot, fires)
