"""Positive bitmasks of the gate: one int32 word per (row, 32 columns), bit c % 32 of word c // 32 set
iff h[row, c] > 0, as the dense_bits GEMM epilogue writes it (kernels/gate_gemm.py).

Popcount and word loading shared by the compactions (kernels/gate_compact.py, kernels/training/train_format.py),
the torch-only packing used as a fallback and as the tests' reference, each unit's positives over a
batch (count_fires) and the K most frequent units (select_hot_units), both without a host sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import cdiv, interpreting, next_pow2
from ._launch import fast


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


def pack_positive_bits(h: torch.Tensor) -> torch.Tensor:
    """int32 [M, F // 32]: bit c % 32 of word [row, c // 32] set iff h[row, c] > 0 (the dense_bits
    epilogue's bitmask, built with torch ops: the fallback when that epilogue cannot compile)."""
    M, F = h.shape
    lanes = torch.arange(32, device=h.device, dtype=torch.int64)
    words = ((h > 0).view(M, F // 32, 32).to(torch.int64) << lanes).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


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


_COUNT_FIRES = fast(_count_fires_kernel)


def count_fires(bits: torch.Tensor) -> torch.Tensor:
    """int32 [F]: positives per column of the bitmask bits [M, F // 32]."""
    M, W = bits.shape
    fires = torch.zeros(W * 32, dtype=torch.int32, device=bits.device)
    wb = 8 if interpreting() else 64
    # Rows per program: whole groups of 31, ~512 programs in all (enough to stream the words at HBM
    # speed), but no more than 32 groups (the loop over groups is sequential).
    groups = 2 if interpreting() else max(1, min(32, cdiv(cdiv(M, _FIRE_GROUP) * cdiv(W, wb), 512)))
    rows = _FIRE_GROUP * groups
    _COUNT_FIRES[(cdiv(M, rows), cdiv(W, wb))](
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


_SELECT_HOT = fast(_select_hot_kernel)


def select_hot_units(fires: torch.Tensor, K: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hot_idx int64 [K] ascending, hot_pos int32 [F], hot_bits int32 [ceil(F / 32)]) of the K largest
    counts in fires (int32 [F]); see _select_hot_kernel."""
    F = fires.shape[0]
    hot_idx = torch.empty(K, dtype=torch.int64, device=fires.device)
    hot_pos = torch.empty(F, dtype=torch.int32, device=fires.device)
    hot_bits = torch.empty(cdiv(F, 32), dtype=torch.int32, device=fires.device)
    block_f = max(32, next_pow2(F))
    warps = 4 if interpreting() else min(16, max(4, block_f // 1024))
    _SELECT_HOT[(1,)](fires, hot_idx, hot_pos, hot_bits, F, K, BLOCK_F=block_f, num_warps=warps)
    return hot_idx, hot_pos, hot_bits
