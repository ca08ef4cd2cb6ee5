"""TwELL compaction: the positives of relu(x w_gate^T) written as per-(row, column tile) entry lists.

Three writers of the same format (kernels/gate.py, TwELLGate): `_compact_chunk`, inside the gate GEMM's
fused epilogue (kernels/gate_gemm.py); the two-kernel path's second kernel from a dense relu buffer h,
either scanning all of h (`_compact_dense_kernel`, "scan") or visiting only the set bits of h's positive
bitmask (`_compact_bits_kernel`, "bits", the GPU default). With hot units, the hot columns go densely to
g_hot and are left out of the entries and counts (kernels/gate.py, twell_gate_hot).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import autotune, cdiv, interpreting, next_pow2
from .bitmask import _popc32, load_bit_words


def _off32(M: int, F: int, tile_n: int, slots: int) -> bool:
    """Whether every entry offset of a TwELL gate of M rows (and a last row block's 256 rows past M)
    fits an int32, so the kernels' OFF32 offset math may skip int64."""
    return (M + 256) * cdiv(F, tile_n) * slots < 2**31


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


_tuned_compact = autotune(configs=_compact_configs(), key=["M_BUCKET", "F", "T", "SLOTS", "TILE_N", "HOT"])(
    _compact_dense_kernel
)


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


_tuned_compact_bits = autotune(
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
