"""Inference rows straight from the gate's positive bitmask: no CSR build, no capacity, no overflow path.

The csr schedule turns the relu GEMM's bitmask into a CSR with three more kernels (row scan, cumsum,
compaction: ~0.08 ms at 16k tokens, ~0.5 ms at 131k on an H200, several times their bytes) before the
row kernel walks it. Here one program per token row does both: it loads the row's F / 32 bit words,
lists the row's positive columns in a row-private scratch window of CAP slots (a positive's slot = the
popcounts of the row's earlier words + its rank in its word, written one lowest-set-bit per word and
iteration, the compaction of kernels/train_format.py), then walks the window CHUNK entries at a time,
gathering h[row, col], w_up[col] and w_down[col] together (the gate value is not copied: its load
overlaps the weight rows'). A row with more than CAP positives (dense rows: the first tokens of a
sequence, dense layers) takes more windows of CAP, in column order: exact, a little slower, counted
as an overflow row. The scratch is written and read back by the same program (a CTA barrier between),
so it lives in L1/L2; unlike the csr schedule's shared capacity nothing ever spills to a slow path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import interpreting, next_pow2
from .gate import _popc32
from .train_sparse import _tuned

# Slots of a row's window: ~4x the paper's ~29 active units per token, so a window per row is the rule.
WINDOW = 128


@triton.jit
def _list_step(words, slot, base, col0, win_ptr, CAP: tl.constexpr):
    """Write each word's lowest positive whose slot lies in [base, base + CAP) to win_ptr[slot - base] (its
    column) and clear it from `words`; returns (words, slot) of what is left."""
    lsb = words ^ (words & (words - 1))
    keep = (words != 0) & (slot < base + CAP)
    tl.store(win_ptr + (slot - base), col0 + _popc32(lsb - 1), mask=keep)
    return tl.where(keep, words ^ lsb, words), tl.where(keep, slot + 1, slot)


@triton.jit
def _window_step(
    e0, n, acc, x, win_ptr, h_row, wu_ptr, wd_ptr, ds, d_ok, D: tl.constexpr, CHUNK: tl.constexpr
):
    offs = e0 + tl.arange(0, CHUNK)
    ok = offs < n
    units = tl.load(win_ptr + offs, mask=ok, other=0).to(tl.int64)
    gate = tl.load(h_row + units, mask=ok, other=0.0).to(tl.float32)
    w_off = units[:, None] * D + ds[None, :]
    live = ok[:, None] & d_ok[None, :]
    wu = tl.load(wu_ptr + w_off, mask=live, other=0.0)
    wd = tl.load(wd_ptr + w_off, mask=live, other=0.0)
    hv = gate * tl.sum(wu.to(tl.float32) * x[None, :], axis=1)
    return acc + tl.sum(hv[:, None] * wd.to(tl.float32), axis=0)


@triton.jit
def _row_bits_kernel(bits_ptr, h_ptr, x_ptr, wu_ptr, wd_ptr, y_ptr, win_ptr, stats_ptr, F: tl.constexpr,
                     D: tl.constexpr, BLOCK_D: tl.constexpr, W_PAD: tl.constexpr, CAP: tl.constexpr,
                     STATS: tl.constexpr, DYNAMIC_LOOPS: tl.constexpr, CHUNK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    ws = tl.arange(0, W_PAD)
    words = tl.load(bits_ptr + row * (F // 32) + ws, mask=ws < F // 32, other=0).to(tl.uint32, bitcast=True)
    pc = _popc32(words)
    n = tl.sum(pc, axis=0)
    slot = tl.cumsum(pc, axis=0) - pc  # the row's positives in earlier words
    col0 = ws * 32
    ds = tl.arange(0, BLOCK_D)
    d_ok = ds < D
    x = tl.load(x_ptr + row * D + ds, mask=d_ok, other=0.0).to(tl.float32)
    h_row = h_ptr + row * F
    win = win_ptr + row * CAP
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    if STATS:
        if n > CAP:
            tl.atomic_add(stats_ptr, 1)
    if DYNAMIC_LOOPS:
        for base in range(0, n, CAP):
            # the most entries one word writes in this window (words done or wholly past it: 0)
            trips = tl.max(tl.minimum(_popc32(words), tl.maximum(base + CAP - slot, 0)), axis=0)
            for _ in range(0, trips):
                words, slot = _list_step(words, slot, base, col0, win, CAP)
            tl.debug_barrier()  # the window's columns, written by all threads, visible to all
            m = tl.minimum(n - base, CAP)
            for e0 in range(0, m, CHUNK):
                acc = _window_step(e0, m, acc, x, win, h_row, wu_ptr, wd_ptr, ds, d_ok, D, CHUNK)
            tl.debug_barrier()  # every thread is done reading before the next window overwrites it
    else:
        base = 0
        while base < n:  # the interpreter cannot range() to a loaded bound (numpy >= 2)
            trips = tl.max(tl.minimum(_popc32(words), tl.maximum(base + CAP - slot, 0)), axis=0)
            t = 0
            while t < trips:
                words, slot = _list_step(words, slot, base, col0, win, CAP)
                t += 1
            m = tl.minimum(n - base, CAP)
            e0 = 0
            while e0 < m:
                acc = _window_step(e0, m, acc, x, win, h_row, wu_ptr, wd_ptr, ds, d_ok, D, CHUNK)
                e0 += CHUNK
            base += CAP
    tl.store(y_ptr + row * D + ds, acc.to(y_ptr.dtype.element_ty), mask=d_ok)


def _configs():
    # The csr row kernel's spill-free set at D 2048 (kernels/train_rowfwd.py), first = the interpreter's.
    return [triton.Config({"CHUNK": c}, num_warps=w) for c, w in ((4, 4), (8, 8), (4, 8), (8, 4))]


_launch = _tuned(_configs(), key=["D", "F"])(_row_bits_kernel)


def row_bits_ffn(
    h: torch.Tensor, bits: torch.Tensor, x: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
    stats: torch.Tensor | None = None, window: int = WINDOW,
) -> torch.Tensor:  # fmt: skip
    """y [M, D] = sum over each row's positives j of h[row, j] * (x[row] . w_up[j]) * w_down[j], with the
    positives read from bits int32 [M, F // 32] (bit b of word w: column 32 w + b; relu_gate_bits' mask
    of h [M, F]). All operands contiguous. `stats` (int32 [1], or None): gains the number of rows with
    more than `window` positives (several windows each). Nothing is dropped on any pattern."""
    M, D = x.shape
    F = h.shape[1]
    if bits.shape != (M, F // 32) or F % 32:
        raise ValueError(f"row_bits_ffn: bits {tuple(bits.shape)} is not the mask of h {tuple(h.shape)}")
    if window < 1:
        raise ValueError(f"row_bits_ffn: window={window} must be >= 1")
    y = torch.empty_like(x)
    if M == 0:
        return y
    cap = min(window, F)
    win = torch.empty(M * cap, device=x.device, dtype=torch.int32)
    _launch[(M,)](
        bits, h, x, w_up, w_down, y, win, stats if stats is not None else win, F=F, D=D, BLOCK_D=next_pow2(D),
        W_PAD=next_pow2(F // 32), CAP=cap, STATS=stats is not None, DYNAMIC_LOOPS=not interpreting(),
    )  # fmt: skip
    return y
