"""Decode-size TwELL FFN (M <= 64 tokens): two kernels, no atomics, no host sync, CUDA-graph capturable.

At decode the gate GEMV streams all of w_gate (23 MB at d 2048 / d_ff 5632) while the sparse part
touches a few hundred KB, so the schedule is built around the GEMV and around kernel count (each
kernel boundary costs ~2-3 us inside a CUDA graph):

1. `_decode_gate_up_kernel`, one program per 32-unit slice of w_gate: pre = x @ w_gate[slice]^T on
   tensor cores (all tokens of the batch in one BLOCK_M tile), g = relu(pre). Only if some unit of
   the slice fires for some token, u = x @ w_up[live]^T with the rows of silent units masked out (a
   masked load moves no bytes), and h = g * u. Writes TwELL tiles of 32 slots (a tile can never
   overflow: slots == tile width) whose values are h itself, not g: the up projection is done.
2. `_decode_down_kernel`, one program per (token, D slice): y[t, slice] = sum_j h_tj w_down[j, slice]
   over the token's entries. Programs own disjoint outputs: no fp32 buffer, no zero fill, no atomics,
   no cast kernel (the row schedule needed all four at decode, NOTES.md round 6).

Exact for any activation pattern (dense rows included: every positive has its slot). The values
round like the row schedule's: g is rounded to x's dtype (as the gate format stores it), u and h stay
fp32, y accumulates in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import cdiv, dot_in_fp32, dot_precision, interpreting, next_pow2
from .gate import _gate_tile_tma, gate_tile_preact

TILE = 32  # units per gate program and per TwELL tile; slots == TILE, so no tile overflows
MAX_TOKENS = 64


@triton.jit
def _decode_gate_up_kernel(
    x_src, wg_src, x_ptr, wu_ptr, counts_ptr, cols_ptr, h_ptr, M, F, M_BUCKET,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, TMA: tl.constexpr, DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    # x_src / wg_src: TMA descriptors (TMA) or the x / w_gate pointers; the up pass uses pointer loads
    # (x_ptr, wu_ptr) because its rows are masked per unit.
    tile = tl.program_id(0)
    T = F // 32
    rows = tl.arange(0, BLOCK_M)
    cols = tile * 32 + tl.arange(0, 32)
    row_ok = rows < M
    if TMA:  # the GEMV streams w_gate through TMA (H200: 2x the bandwidth of pointer loads here)
        pre = _gate_tile_tma(x_src, wg_src, 0, tile * 32, D, BLOCK_M, 32, BLOCK_K, DOT_FP32, PRECISION)
    else:
        pre = gate_tile_preact(x_src, wg_src, rows, cols, M, F, D, BLOCK_M, 32, BLOCK_K, DOT_FP32, PRECISION)
    active = (pre > 0) & row_ok[:, None]
    # The gate value as the TwELL format stores it (x's dtype), so every schedule multiplies the same g.
    g = tl.where(active, pre, 0.0).to(x_ptr.dtype.element_ty).to(tl.float32)
    live = tl.max(active.to(tl.int32), axis=0) > 0  # [32]: units that fire for some token
    act_i = active.to(tl.int32)
    count = tl.sum(act_i, axis=1)
    h = tl.zeros((BLOCK_M, 32), dtype=tl.float32)
    if tl.sum(live.to(tl.int32), axis=0) > 0:
        # u = x @ w_up[live]^T; silent units' rows are masked out, so only live rows are read.
        ks = tl.arange(0, BLOCK_K)
        safe_rows = tl.minimum(rows, M - 1)
        x_ptrs = x_ptr + safe_rows[:, None].to(tl.int64) * D + ks[None, :]
        w_ptrs = wu_ptr + cols[None, :].to(tl.int64) * D + ks[:, None]
        w_mask = live[None, :] & (ks < BLOCK_K)[:, None]
        u = tl.zeros((BLOCK_M, 32), dtype=tl.float32)
        for _ in range(0, D, BLOCK_K):
            a = tl.load(x_ptrs)
            b = tl.load(w_ptrs, mask=w_mask, other=0.0)
            if DOT_FP32:  # the interpreter's 16-bit tl.dot is wrong; upcast there only
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            u = tl.dot(a, b, u, input_precision=PRECISION)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        h = g * u
    # Compact each row's positives in column order: slot = rank among the row's positives of the tile.
    slot = tl.cumsum(act_i, axis=1) - 1
    entry = ((rows * T + tile) * 32)[:, None] + slot
    tl.store(cols_ptr + entry, cols[None, :].to(cols_ptr.dtype.element_ty), mask=active)
    tl.store(h_ptr + entry, h, mask=active)
    tl.store(counts_ptr + rows * T + tile, count, mask=row_ok)


@triton.jit
def _decode_down_kernel(
    counts_ptr, cols_ptr, h_ptr, wd_ptr, y_ptr, M_BUCKET,
    T: tl.constexpr, T_PAD: tl.constexpr, D: tl.constexpr, BLOCK_DS: tl.constexpr, CHUNK: tl.constexpr,
    DYNAMIC_LOOPS: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
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
            acc += _down_chunk(e0 + lanes, total, incl, excl, ts, row, cols_ptr, h_ptr, wd_ptr, ds, T, D)
    else:  # the interpreter cannot loop to a loaded bound: walk every slot, masked
        for e0 in range(0, T * 32, CHUNK):
            acc += _down_chunk(e0 + lanes, total, incl, excl, ts, row, cols_ptr, h_ptr, wd_ptr, ds, T, D)
    tl.store(y_ptr + row * D + ds, acc.to(y_ptr.dtype.element_ty))


@triton.jit
def _down_chunk(e, total, incl, excl, ts, row, cols_ptr, h_ptr, wd_ptr, ds, T: tl.constexpr, D: tl.constexpr):
    """sum over the row's flattened entries e ([CHUNK] indices across its tiles) of h * w_down[j, ds]."""
    ok = e < total
    ends_before = (incl[None, :] <= e[:, None]) & (ts[None, :] < T)
    tile_of = tl.sum(ends_before.to(tl.int32), axis=1)
    start = tl.sum(tl.where(ts[None, :] == tile_of[:, None], excl[None, :], 0), axis=1)
    entry = (row * T + tile_of) * 32 + (e - start)
    units = tl.load(cols_ptr + entry, mask=ok, other=0).to(tl.int64)
    h = tl.load(h_ptr + entry, mask=ok, other=0.0)
    wd = tl.load(wd_ptr + units[:, None] * D + ds[None, :], mask=ok[:, None], other=0.0)
    return tl.sum(h[:, None] * wd.to(tl.float32), axis=0)


def _set_desc_blocks(nargs):
    """Autotune pre-hook: TMA descriptors carry the block shape, which depends on BLOCK_K."""
    if nargs["TMA"]:
        nargs["x_src"].block_shape = [nargs["BLOCK_M"], nargs["BLOCK_K"]]
        nargs["wg_src"].block_shape = [TILE, nargs["BLOCK_K"]]


def _prune_block_k(configs, named_args, **kwargs):
    D = kwargs.get("D", named_args.get("D"))
    kept = [c for c in configs if D % c.kwargs["BLOCK_K"] == 0]
    return kept or [triton.Config({"BLOCK_K": 64}, num_warps=4, num_stages=4, pre_hook=_set_desc_blocks)]


# The GEMV lives off bytes in flight per SM: wide K steps and deep pipelines (F/32 = 176 programs at
# d_ff 5632, ~1.3 per SM, each streaming 32 rows of w_gate).
_GATE_CONFIGS = [
    triton.Config({"BLOCK_K": bk}, num_warps=w, num_stages=s, pre_hook=_set_desc_blocks)
    for bk, w, s in ((128, 4, 4), (128, 4, 6), (256, 4, 4), (256, 8, 3), (512, 4, 2), (512, 8, 3))
]
_tuned_gate_up = triton.autotune(
    configs=_GATE_CONFIGS, key=["M_BUCKET", "F", "D"], prune_configs_by={"early_config_prune": _prune_block_k}
)(_decode_gate_up_kernel)


def _prune_block_ds(configs, named_args, **kwargs):
    D = kwargs.get("D", named_args.get("D"))
    kept = [c for c in configs if D % c.kwargs["BLOCK_DS"] == 0]
    return kept or [triton.Config({"BLOCK_DS": 64, "CHUNK": 16}, num_warps=2)]


# D slices per token: narrow slices put more programs on the SMs at 1-4 tokens; whole rows (the row
# consumer's shape, ~4 KB per load) suit 64 tokens.
_DOWN_CONFIGS = [
    triton.Config({"BLOCK_DS": bd, "CHUNK": ch}, num_warps=w)
    for bd, ch, w in ((128, 16, 4), (256, 16, 4), (512, 16, 8), (1024, 8, 8), (2048, 4, 8), (2048, 8, 8))
]
_tuned_down = triton.autotune(
    configs=_DOWN_CONFIGS,
    key=["M_BUCKET", "T", "D"],
    prune_configs_by={"early_config_prune": _prune_block_ds},
)(_decode_down_kernel)


def _use_tma(x: torch.Tensor, w_gate: torch.Tensor) -> bool:
    """TMA on Hopper and later (and under the interpreter, which emulates it) for 16-byte aligned bases."""
    if not interpreting() and torch.cuda.get_device_capability(x.device)[0] < 9:
        return False
    return x.data_ptr() % 16 == 0 and w_gate.data_ptr() % 16 == 0


def decode_ffn(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor):
    """y = (relu(x w_gate^T) * (x w_up^T)) @ w_down for M <= MAX_TOKENS rows; returns (y, counts [M, T]).

    Arguments are checked by the caller (twell_ffn_inference). counts are the true positives per
    (token, 32-unit tile); none is ever over the 32 slots."""
    M, D = x.shape
    F = w_gate.shape[0]
    if M > MAX_TOKENS:
        raise ValueError(f"the decode schedule takes at most {MAX_TOKENS} tokens (got {M}); use 'row'")
    T = F // TILE
    block_m = max(16, next_pow2(M))
    col_dtype = torch.int16 if F <= torch.iinfo(torch.int16).max else torch.int32
    counts = torch.empty((M, T), dtype=torch.int32, device=x.device)
    cols = torch.empty((M, T, TILE), dtype=col_dtype, device=x.device)
    h = torch.empty((M, T, TILE), dtype=torch.float32, device=x.device)
    y = torch.empty_like(x)
    m_bucket = next_pow2(M)
    tma = _use_tma(x, w_gate)
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        block_k = 64  # placeholder on a GPU: the autotuner's pre-hook sets the config's block shape
        x_src = TensorDescriptor.from_tensor(x, [block_m, block_k])
        wg_src = TensorDescriptor.from_tensor(w_gate, [TILE, block_k])
    else:
        x_src, wg_src = x, w_gate
    gate_args = (x_src, wg_src, x, w_up, counts, cols, h, M, F, m_bucket)
    gate_kw = dict(
        D=D, BLOCK_M=block_m, TMA=tma, DOT_FP32=dot_in_fp32(x.dtype), PRECISION=dot_precision(x.dtype)
    )
    down_args = (counts, cols, h, w_down, y, m_bucket)
    down_kw = dict(T=T, T_PAD=next_pow2(T), D=D)
    if interpreting():
        _decode_gate_up_kernel[(T,)](*gate_args, BLOCK_K=64, **gate_kw)
        _decode_down_kernel[(M, cdiv(D, 64))](
            *down_args, BLOCK_DS=64, CHUNK=16, DYNAMIC_LOOPS=False, **down_kw
        )
        return y, counts
    _tuned_gate_up[(T,)](*gate_args, **gate_kw)
    _tuned_down[lambda meta: (M, D // meta["BLOCK_DS"])](*down_args, DYNAMIC_LOOPS=True, **down_kw)
    return y, counts
