"""Gate GEMM with a sparse TwELL epilogue: relu(x @ w_gate^T) written as per-(row, column tile) lists.

Each program computes a [BLOCK_M, tile_n] tile of the gate pre-activation on tensor cores, applies
ReLU and compacts every row of the tile in registers: a prefix sum over the positive mask gives each
positive value its slot, so the (column, value) entries land in order without atomics, without a dense
h in memory and without a host sync. The count stored is the TRUE count of positives in the
(row, tile); entries past `slots` are not stored and consumers must recompute such overflow tiles.
"""

from __future__ import annotations

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
)


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
    """fp32 [BLOCK_M, BLOCK_N] tile of x @ w^T (x [M, D], w [F, D], row-major; D % BLOCK_K == 0; D is constexpr
    because the interpreter cannot loop to a runtime bound inside a nested jit function)."""
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * D + ks[None, :]
    w_ptrs = w_ptr + cols[None, :].to(tl.int64) * D + ks[:, None]
    row_ok = rows[:, None] < M
    col_ok = cols[None, :] < F
    for _ in range(0, D, BLOCK_K):
        a = tl.load(x_ptrs, mask=row_ok, other=0.0)
        b = tl.load(w_ptrs, mask=col_ok, other=0.0)
        if DOT_FP32:  # the interpreter's 16-bit tl.dot is wrong; upcast there only
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    return acc


@triton.jit
def _twell_gate_kernel(
    x_ptr,
    w_ptr,
    counts_ptr,
    cols_ptr,
    vals_ptr,
    M,
    F,
    D: tl.constexpr,
    T,
    SLOTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # Grouped ordering: consecutive programs share w tiles in L2 (the weight is the reused operand).
    pid = tl.program_id(0)
    n_m = tl.cdiv(M, BLOCK_M)
    per_group = GROUP_M * T
    group = pid // per_group
    first_m = group * GROUP_M
    group_size = tl.minimum(n_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_size
    tile = (pid % per_group) // group_size

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    pre = gate_tile_preact(x_ptr, w_ptr, rows, cols, M, F, D, BLOCK_M, BLOCK_N, BLOCK_K, DOT_FP32, PRECISION)

    active = (pre > 0) & (cols[None, :] < F)
    act_i = active.to(tl.int32)
    slot = tl.cumsum(act_i, axis=1) - 1  # position of each positive value among its row's positives
    count = tl.sum(act_i, axis=1)
    row_ok = rows < M
    tl.store(counts_ptr + rows.to(tl.int64) * T + tile, count, mask=row_ok)
    keep = active & (slot < SLOTS) & row_ok[:, None]
    entry = (rows[:, None].to(tl.int64) * T + tile) * SLOTS + slot
    tl.store(cols_ptr + entry, cols[None, :].to(cols_ptr.dtype.element_ty), mask=keep)
    tl.store(vals_ptr + entry, pre.to(vals_ptr.dtype.element_ty), mask=keep)


def _gate_configs(tile_n: int) -> list[triton.Config]:
    # A handful: 128-row tiles for large M (tensor-core efficiency), 64 rows for small M.
    out = []
    for bm, warps, stages in ((128, 8, 3), (128, 4, 4), (64, 4, 4), (64, 8, 3)):
        if bm * tile_n > 128 * 256:
            continue
        out.append(triton.Config({"BLOCK_M": bm, "BLOCK_K": 64}, num_warps=warps, num_stages=stages))
    return out


_TUNED: dict[int, object] = {}


def _tuned_kernel(tile_n: int):
    """The gate kernel autotuned over row-tile shapes for a fixed format width tile_n (= the N tile)."""
    if tile_n not in _TUNED:
        _TUNED[tile_n] = triton.autotune(configs=_gate_configs(tile_n), key=["M_BUCKET", "F", "D"])(
            _launchable
        )
    return _TUNED[tile_n]


@triton.jit
def _launchable(
    x_ptr,
    w_ptr,
    counts_ptr,
    cols_ptr,
    vals_ptr,
    M,
    F,
    D: tl.constexpr,
    T,
    M_BUCKET,
    SLOTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # M_BUCKET (a power of two) only keys the autotuning cache so decode and prefill tune apart.
    _twell_gate_kernel(
        x_ptr,
        w_ptr,
        counts_ptr,
        cols_ptr,
        vals_ptr,
        M,
        F,
        D,
        T,
        SLOTS,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
        DOT_FP32,
        PRECISION,
        GROUP_M,
    )


def default_tile_n(M: int, F: int) -> int:
    """Format width: 256 (the paper's) for large batches; narrower tiles give small batches more programs."""
    if interpreting():
        return 64
    if M >= 2048 and F >= 2048:
        return 256
    return 128 if M >= 256 else 64


def default_slots(tile_n: int) -> int:
    # ~1/8 of the tile: 32 entries at tile_n 256, far above the ~1.3 a typical row puts in a tile.
    return max(8, tile_n // 8)


def twell_gate(
    x: torch.Tensor, w_gate: torch.Tensor, *, slots: int | None = None, tile_n: int | None = None
) -> TwELLGate:
    """relu(x @ w_gate^T) in TwELL form (see TwELLGate); counts may exceed slots (overflow tiles)."""
    check_x_weight(x, w_gate, "w_gate")
    check_kernel_device(x)
    M, D = x.shape
    F = w_gate.shape[0]
    tile_n = default_tile_n(M, F) if tile_n is None else int(tile_n)
    if tile_n not in (64, 128, 256):
        raise ValueError(f"tile_n={tile_n} is not supported; use 64, 128 or 256")
    slots = default_slots(tile_n) if slots is None else int(slots)
    if not 1 <= slots <= tile_n:
        raise ValueError(f"slots={slots} must be in [1, tile_n={tile_n}]")
    T = cdiv(F, tile_n)
    col_dtype = torch.int16 if F <= torch.iinfo(torch.int16).max else torch.int32
    counts = torch.empty((M, T), dtype=torch.int32, device=x.device)
    cols = torch.empty((M, T, slots), dtype=col_dtype, device=x.device)
    vals = torch.empty((M, T, slots), dtype=x.dtype, device=x.device)
    common = dict(
        SLOTS=slots,
        BLOCK_N=tile_n,
        DOT_FP32=dot_in_fp32(x.dtype),
        PRECISION=dot_precision(x.dtype),
        GROUP_M=8,
    )
    if interpreting():
        block_m = 32
        grid = (cdiv(M, block_m) * T,)
        _twell_gate_kernel[grid](
            x, w_gate, counts, cols, vals, M, F, D, T, BLOCK_M=block_m, BLOCK_K=64, **common
        )
    else:
        grid = lambda meta: (cdiv(M, meta["BLOCK_M"]) * T,)
        m_bucket = min(triton.next_power_of_2(M), 1 << 17)
        _tuned_kernel(tile_n)[grid](x, w_gate, counts, cols, vals, M, F, D, T, m_bucket, **common)
    return TwELLGate(counts, cols, vals, tile_n, slots)
