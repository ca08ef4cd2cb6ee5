"""The "block" inference schedule: tensor cores on the union of a row block's active units.

1. gate GEMM; its epilogue ORs the positive mask over the BLOCK_M rows of the tile and compacts the
   union of active columns (prefix sum), writing per (row block, column tile) the union count, the
   union's columns and the block's gate values at those columns only ([BLOCK_M, count]).
2. up: H = G * (X_block @ w_up[union]^T) on tensor cores, written over G in place (compact, so h in
   this form is the size of the gate's sparse output, never [M, d_ff]).
3. down: y_block = sum over tiles of H @ w_down[union] on tensor cores.
Each weight row is read once per row block instead of once per (token, unit) pair. A union never
holds more than the tile's width, so there is no overflow path: exact for every pattern.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import cdiv, dot_in_fp32, dot_precision, interpreting
from .gate import gate_tile_preact


@triton.jit
def _gate_union_kernel(
    x_ptr,
    wg_ptr,
    ucount_ptr,
    ucols_ptr,
    g_ptr,
    M,
    F,
    T,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    block = tl.program_id(0)
    tile = tl.program_id(1)
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile * TILE_N + tl.arange(0, TILE_N)
    pre = gate_tile_preact(x_ptr, wg_ptr, rows, cols, M, F, D, BLOCK_M, TILE_N, BLOCK_K, DOT_FP32, PRECISION)
    active = (pre > 0) & (cols[None, :] < F) & (rows[:, None] < M)
    in_union = tl.max(active.to(tl.int32), axis=0)  # [TILE_N]: any row of the block fires this unit
    pos = tl.cumsum(in_union, axis=0) - 1
    bt = block.to(tl.int64) * T + tile
    tl.store(ucount_ptr + bt, tl.sum(in_union, axis=0))
    tl.store(ucols_ptr + bt * TILE_N + pos, cols, mask=in_union > 0)
    g_off = (rows[:, None].to(tl.int64) * T + tile) * TILE_N + pos[None, :]
    keep = (in_union > 0)[None, :] & (rows[:, None] < M)
    tl.store(g_ptr + g_off, tl.maximum(pre, 0.0).to(g_ptr.dtype.element_ty), mask=keep)


@triton.jit
def _union_up_chunk(
    x_ptr,
    wu_ptr,
    ucols_ptr,
    g_ptr,
    rows,
    bt,
    tile,
    k,
    count,
    M,
    F,
    T,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    k_ok = k < count
    units = tl.load(ucols_ptr + bt * TILE_N + k, mask=k_ok, other=F)  # F: masked out by the GEMM
    up = gate_tile_preact(x_ptr, wu_ptr, rows, units, M, F, D, BLOCK_M, CHUNK, BLOCK_K, DOT_FP32, PRECISION)
    g_off = (rows[:, None].to(tl.int64) * T + tile) * TILE_N + k[None, :]
    ok = (rows[:, None] < M) & k_ok[None, :]
    gate = tl.load(g_ptr + g_off, mask=ok, other=0.0).to(tl.float32)
    tl.store(g_ptr + g_off, (gate * up).to(g_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _union_up_kernel(
    x_ptr,
    wu_ptr,
    ucount_ptr,
    ucols_ptr,
    g_ptr,
    M,
    F,
    T: tl.constexpr,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
    DYNAMIC_LOOPS: tl.constexpr,
):
    block = tl.program_id(0)
    tile = tl.program_id(1)
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    bt = block.to(tl.int64) * T + tile
    count = tl.load(ucount_ptr + bt)
    lanes = tl.arange(0, CHUNK)
    # Loop to the count on GPU; the interpreter cannot loop to a loaded bound, so it masks.
    if DYNAMIC_LOOPS:
        for k0 in range(0, count, CHUNK):
            _union_up_chunk(
                x_ptr,
                wu_ptr,
                ucols_ptr,
                g_ptr,
                rows,
                bt,
                tile,
                k0 + lanes,
                count,
                M,
                F,
                T,
                D,
                BLOCK_M,
                TILE_N,
                CHUNK,
                BLOCK_K,
                DOT_FP32,
                PRECISION,
            )
    else:
        for k0 in range(0, TILE_N, CHUNK):
            _union_up_chunk(
                x_ptr,
                wu_ptr,
                ucols_ptr,
                g_ptr,
                rows,
                bt,
                tile,
                k0 + lanes,
                count,
                M,
                F,
                T,
                D,
                BLOCK_M,
                TILE_N,
                CHUNK,
                BLOCK_K,
                DOT_FP32,
                PRECISION,
            )


@triton.jit
def _union_down_chunk(
    acc,
    wd_ptr,
    ucols_ptr,
    h_ptr,
    rows,
    bt,
    tile,
    k,
    count,
    dcols,
    M,
    T,
    D: tl.constexpr,
    TILE_N: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    k_ok = k < count
    units = tl.load(ucols_ptr + bt * TILE_N + k, mask=k_ok, other=0).to(tl.int64)
    h_off = (rows[:, None].to(tl.int64) * T + tile) * TILE_N + k[None, :]
    h = tl.load(h_ptr + h_off, mask=(rows[:, None] < M) & k_ok[None, :], other=0.0)
    wd = tl.load(wd_ptr + units[:, None] * D + dcols[None, :], mask=k_ok[:, None], other=0.0)
    if DOT_FP32:
        h = h.to(tl.float32)
        wd = wd.to(tl.float32)
    return tl.dot(h, wd, acc, input_precision=PRECISION)


@triton.jit
def _union_down_kernel(
    wd_ptr,
    ucount_ptr,
    ucols_ptr,
    h_ptr,
    y_ptr,
    M,
    T: tl.constexpr,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
    DYNAMIC_LOOPS: tl.constexpr,
):
    block = tl.program_id(0)
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    dcols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    lanes = tl.arange(0, CHUNK)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    for tile in range(T):
        bt = block.to(tl.int64) * T + tile
        count = tl.load(ucount_ptr + bt)
        if DYNAMIC_LOOPS:
            for k0 in range(0, count, CHUNK):
                acc = _union_down_chunk(
                    acc,
                    wd_ptr,
                    ucols_ptr,
                    h_ptr,
                    rows,
                    bt,
                    tile,
                    k0 + lanes,
                    count,
                    dcols,
                    M,
                    T,
                    D,
                    TILE_N,
                    DOT_FP32,
                    PRECISION,
                )
        else:
            for k0 in range(0, TILE_N, CHUNK):
                acc = _union_down_chunk(
                    acc,
                    wd_ptr,
                    ucols_ptr,
                    h_ptr,
                    rows,
                    bt,
                    tile,
                    k0 + lanes,
                    count,
                    dcols,
                    M,
                    T,
                    D,
                    TILE_N,
                    DOT_FP32,
                    PRECISION,
                )
    y_off = rows[:, None].to(tl.int64) * D + dcols[None, :]
    tl.store(y_ptr + y_off, acc.to(y_ptr.dtype.element_ty), mask=rows[:, None] < M)


def default_block_config(M: int) -> dict:
    """Row block, chunk of union units per tensor-core step, output columns per down program."""
    if interpreting():
        return dict(block_m=16, tile_n=64, chunk=16, block_d=64)
    if M <= 16:
        return dict(block_m=16, tile_n=64, chunk=32, block_d=64)
    if M <= 64:
        return dict(block_m=M if M in (32, 64) else 64, tile_n=64, chunk=32, block_d=64)
    return dict(block_m=64, tile_n=128, chunk=64, block_d=128)


def block_schedule(x, w_gate, w_up, w_down, tile_n=None):
    """y of the FFN through the union schedule, plus InferenceStats (no overflow path: 0 rows)."""
    from .inference import InferenceStats

    M, D = x.shape
    F = w_gate.shape[0]
    cfg = default_block_config(M)
    tile_n = cfg["tile_n"] if tile_n is None else int(tile_n)
    block_m, chunk, block_d = cfg["block_m"], min(cfg["chunk"], tile_n), min(cfg["block_d"], D)
    T = cdiv(F, tile_n)
    n_blocks = cdiv(M, block_m)
    dev = x.device
    ucount = torch.empty((n_blocks, T), dtype=torch.int32, device=dev)
    ucols = torch.empty((n_blocks, T, tile_n), dtype=torch.int32, device=dev)
    g = torch.empty((M, T, tile_n), dtype=x.dtype, device=dev)  # only each union's prefix is written
    y = torch.empty_like(x)
    flags = dict(DOT_FP32=dot_in_fp32(x.dtype), PRECISION=dot_precision(x.dtype))
    dyn = not interpreting()
    _gate_union_kernel[(n_blocks, T)](
        x,
        w_gate,
        ucount,
        ucols,
        g,
        M,
        F,
        T,
        D=D,
        BLOCK_M=block_m,
        TILE_N=tile_n,
        BLOCK_K=64,
        num_warps=4,
        num_stages=3,
        **flags,
    )
    _union_up_kernel[(n_blocks, T)](
        x,
        w_up,
        ucount,
        ucols,
        g,
        M,
        F,
        T=T,
        D=D,
        BLOCK_M=block_m,
        TILE_N=tile_n,
        CHUNK=chunk,
        BLOCK_K=64,
        DYNAMIC_LOOPS=dyn,
        num_warps=4,
        num_stages=3,
        **flags,
    )
    _union_down_kernel[(n_blocks, cdiv(D, block_d))](
        w_down,
        ucount,
        ucols,
        g,
        y,
        M,
        T=T,
        D=D,
        BLOCK_M=block_m,
        TILE_N=tile_n,
        CHUNK=chunk,
        BLOCK_D=block_d,
        DYNAMIC_LOOPS=dyn,
        num_warps=4,
        num_stages=3,
        **flags,
    )
    return y, InferenceStats(torch.zeros((), dtype=torch.int32, device=dev))
