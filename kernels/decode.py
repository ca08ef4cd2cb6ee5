"""Decode-size TwELL FFN (a few tokens): two kernels, no atomics, no host sync, CUDA-graph capturable.

At decode the gate GEMV streams all of w_gate (23 MB at d 2048 / d_ff 5632) while the sparse part
touches a few hundred KB, and inside a CUDA graph every kernel boundary costs ~2 us (H200,
NOTES.md round 7). The row schedule's decode path needs four kernels (gate, zero an fp32 y, a consumer
whose SPLIT programs per token add into it with atomics, cast); this one needs two:

1. `twell_gate` with 32-unit tiles of 32 slots (a tile can never overflow), F/32 programs streaming
   w_gate through TMA.
2. `_decode_consumer_kernel`, one program per (token, D slice): for each of the token's entries it
   computes the full dot u = x . w_up[j] (whole rows) and adds g * u * w_down[j, slice] into its slice.
   Programs own disjoint outputs: y is written once, in x's dtype. The price is that each of a
   token's S slices recomputes its dots (S x the w_up bytes, from L2 after the first), so S shrinks
   as tokens grow (`decode_slices`).

Exact for any pattern (dense rows included: every positive has its slot). Values round like the row
schedule's: g in x's dtype (the format's), u and the sums in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import interpreting, next_pow2
from .gate import twell_gate

TILE = 32  # units per gate program and per TwELL tile; slots == TILE, so no tile overflows
MAX_TOKENS = 64
# Programs a decode step should put on the GPU (H200: 132 SMs) before slicing D further costs more
# in recomputed dots than it gains in parallelism.
TARGET_PROGRAMS = 128


@triton.jit
def _decode_consumer_kernel(
    x_ptr, wu_ptr, wd_ptr, y_ptr, counts_ptr, cols_ptr, vals_ptr,
    T: tl.constexpr, T_PAD: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DS: tl.constexpr,
    CHUNK: tl.constexpr, DYNAMIC_LOOPS: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    ds_all = tl.arange(0, BLOCK_D)
    d_ok = ds_all < D
    x = tl.load(x_ptr + row * D + ds_all, mask=d_ok, other=0.0).to(tl.float32)
    ds = tl.program_id(1) * BLOCK_DS + tl.arange(0, BLOCK_DS)
    ts = tl.arange(0, T_PAD)
    counts = tl.load(counts_ptr + row * T + ts, mask=ts < T, other=0)
    incl = tl.cumsum(counts, axis=0)
    excl = incl - counts
    total = tl.sum(counts, axis=0)
    acc = tl.zeros((BLOCK_DS,), dtype=tl.float32)
    lanes = tl.arange(0, CHUNK)
    if DYNAMIC_LOOPS:
        for e0 in range(0, total, CHUNK):
            acc += _slice_chunk(
                e0 + lanes, total, incl, excl, ts, row, cols_ptr, vals_ptr, wu_ptr, wd_ptr, x, ds_all, d_ok, ds,
                T, D,
            )  # fmt: skip
    else:  # the interpreter cannot loop to a loaded bound: walk every slot, masked
        for e0 in range(0, T * 32, CHUNK):
            acc += _slice_chunk(
                e0 + lanes, total, incl, excl, ts, row, cols_ptr, vals_ptr, wu_ptr, wd_ptr, x, ds_all, d_ok, ds,
                T, D,
            )  # fmt: skip
    tl.store(y_ptr + row * D + ds, acc.to(y_ptr.dtype.element_ty))


@triton.jit
def _slice_chunk(
    e, total, incl, excl, ts, row, cols_ptr, vals_ptr, wu_ptr, wd_ptr, x, ds_all, d_ok, ds,
    T: tl.constexpr, D: tl.constexpr,
):  # fmt: skip
    """sum over the token's flattened entries e ([CHUNK] indices across its tiles) of
    g * (x . w_up[j]) * w_down[j, ds]."""
    ok = e < total
    ends_before = (incl[None, :] <= e[:, None]) & (ts[None, :] < T)
    tile_of = tl.sum(ends_before.to(tl.int32), axis=1)
    start = tl.sum(tl.where(ts[None, :] == tile_of[:, None], excl[None, :], 0), axis=1)
    entry = (row * T + tile_of) * 32 + (e - start)
    units = tl.load(cols_ptr + entry, mask=ok, other=0).to(tl.int64)
    gate = tl.load(vals_ptr + entry, mask=ok, other=0.0).to(tl.float32)
    # Both weight loads issue before any math so their latencies overlap; weights are the reused operand.
    wu = tl.load(wu_ptr + units[:, None] * D + ds_all[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)
    wd = tl.load(wd_ptr + units[:, None] * D + ds[None, :], mask=ok[:, None], other=0.0)
    h = gate * tl.sum(wu.to(tl.float32) * x[None, :], axis=1)
    return tl.sum(h[:, None] * wd.to(tl.float32), axis=0)


_settings = {"slices": None}


def set_decode_slices(slices: int | None) -> None:
    """Benchmark switch: D slices per token for every decode call (None: decode_slices' choice)."""
    _settings["slices"] = None if slices is None else int(slices)


def decode_slices(M: int, D: int) -> int:
    """D slices per token: enough programs (M x S ~ TARGET_PROGRAMS) with each slice >= 128 wide."""
    if _settings["slices"] is not None:
        return _settings["slices"]
    s = max(1, TARGET_PROGRAMS // M)
    return max(1, min(next_pow2(s), D // 128 if D >= 128 else 1))


def decode_ffn(
    x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, *, slices=None
):
    """y = (relu(x w_gate^T) * (x w_up^T)) @ w_down for M <= MAX_TOKENS rows; returns (y, counts [M, T]).

    Arguments are checked by the caller (twell_ffn_inference). counts are the true positives per
    (token, 32-unit tile); none is ever over the 32 slots. slices: D slices per token (None:
    decode_slices; a power of two dividing D into slices of >= 16)."""
    M, D = x.shape
    if M > MAX_TOKENS:
        raise ValueError(f"the decode schedule takes at most {MAX_TOKENS} tokens (got {M}); use 'row'")
    S = decode_slices(M, D) if slices is None else int(slices)
    if S < 1 or S & (S - 1) or D % S or D // S < 16:
        raise ValueError(f"slices={S} must be a power of two dividing d_model={D} into slices of >= 16")
    gate = twell_gate(x, w_gate, tile_n=TILE, slots=TILE)
    T = gate.counts.shape[1]
    y = torch.empty_like(x)
    block_d = next_pow2(D)
    # [CHUNK, D] w_up rows per step: 16 KB of bf16 at CHUNK 4 / D 2048, within registers at 8 warps.
    chunk = 16 if interpreting() else max(2, min(8, 8192 // block_d))
    _decode_consumer_kernel[(M, S)](
        x, w_up, w_down, y, gate.counts, gate.cols, gate.vals,
        T=T, T_PAD=next_pow2(T), D=D, BLOCK_D=block_d, BLOCK_DS=D // S, CHUNK=chunk,
        DYNAMIC_LOOPS=not interpreting(), num_warps=4 if interpreting() else 8,
    )  # fmt: skip
    return y, gate.counts
