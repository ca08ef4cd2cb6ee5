"""Fused decode FFN (a few tokens): gate, up and down in one kernel, no TwELL buffers, no compaction.

At decode sizes the row schedule runs a chain of small kernels (gate with TwELL epilogue, a zeroed fp32
buffer, the split consumer, a cast) whose launch latencies cost as much as the weight reads. Here one
program per BN-unit slice of d_ff:
  1. g = relu(x @ w_gate[slice]^T) on tensor cores ([BM, BN], BM = tokens padded to >= 16);
  2. if any unit of the slice fires for any token: u = x @ w_up[slice]^T with only the live units'
     rows loaded (masked loads of dead rows move no bytes), h = g * u;
  3. y32[:, :] += h @ w_down[slice] (live rows only), fp32 atomics.
Slices where nothing fires (most of them at one token: ~29 of 5632 units) stop after step 1, so the
weights read are w_gate once plus two rows per live unit, as in the row schedule, in two kernels fewer.
Exact for any pattern: there are no slots to overflow. The atomics make the fp32 sum order vary
between runs (last-bit differences only); the cost grows with tokens x live slices, so the default
uses it only up to FUSED_MAX_TOKENS (chosen by measurement, kernels/NOTES.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import dot_in_fp32, dot_precision, interpreting, next_pow2

FUSED_MAX_M = 64  # the kernel's limit (BM <= 64); the default threshold lives in inference.py


@triton.jit
def _fused_decode_kernel(
    x_ptr,
    wg_ptr,
    wu_ptr,
    wd_ptr,
    y32_ptr,
    M,
    F,
    M_BUCKET,
    D: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    BD: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = tl.arange(0, BM)
    row_ok = rows < M
    units = pid * BN + tl.arange(0, BN)
    unit_ok = units < F
    w_rows = units.to(tl.int64)[:, None] * D
    ks = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, D, BK):
        k_ok = (k0 + ks) < D
        xk = tl.load(x_ptr + rows[:, None] * D + (k0 + ks)[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        wk = tl.load(wg_ptr + w_rows + (k0 + ks)[None, :], mask=unit_ok[:, None] & k_ok[None, :], other=0.0)
        if DOT_FP32:
            xk, wk = xk.to(tl.float32), wk.to(tl.float32)
        acc = tl.dot(xk, tl.trans(wk), acc, input_precision=PRECISION)
    # Round like the TwELL values of the row schedule (stored in x's dtype), so both give the same h.
    g = tl.maximum(acc, 0.0).to(x_ptr.dtype.element_ty).to(tl.float32)
    live = (g > 0) & row_ok[:, None]
    unit_live = tl.max(live.to(tl.int32), axis=0) > 0  # [BN]: fires for some token
    if tl.max(unit_live.to(tl.int32), axis=0) > 0:
        acc_u = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, D, BK):
            k_ok = (k0 + ks) < D
            xk = tl.load(
                x_ptr + rows[:, None] * D + (k0 + ks)[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0
            )
            wk = tl.load(wu_ptr + w_rows + (k0 + ks)[None, :], mask=unit_live[:, None] & k_ok[None, :], other=0.0)
            if DOT_FP32:
                xk, wk = xk.to(tl.float32), wk.to(tl.float32)
            acc_u = tl.dot(xk, tl.trans(wk), acc_u, input_precision=PRECISION)
        h = tl.where(live, g * acc_u, 0.0)
        if DOT_FP32:
            h_op = h
        else:
            h_op = h.to(x_ptr.dtype.element_ty)  # the dense FFN's h is in x's dtype too
        ds = tl.arange(0, BD)
        for d0 in range(0, D, BD):
            d_ok = (d0 + ds) < D
            wd = tl.load(wd_ptr + w_rows + (d0 + ds)[None, :], mask=unit_live[:, None] & d_ok[None, :], other=0.0)
            if DOT_FP32:
                wd = wd.to(tl.float32)
            part = tl.dot(h_op, wd, input_precision=PRECISION)
            tl.atomic_add(
                y32_ptr + rows[:, None] * D + (d0 + ds)[None, :],
                part,
                mask=row_ok[:, None] & d_ok[None, :],
                sem="relaxed",
            )


def _configs() -> list[triton.Config]:
    # BN: slices per GPU (F / BN programs stream w_gate); BK: bytes in flight per step.
    # A short list: every config compiles per token bucket, and decode latency is what is being saved.
    # Wider slices mean fewer fp32 atomics (tokens x d_model per live slice) where many tokens share them.
    shapes = ((16, 128, 4), (16, 256, 4), (32, 128, 4), (32, 256, 4), (32, 128, 2), (64, 128, 4), (128, 64, 8))
    return [triton.Config({"BN": bn, "BK": bk, "BD": 128}, num_warps=w, num_stages=4) for bn, bk, w in shapes]


_tuned = triton.autotune(configs=_configs(), key=["M_BUCKET", "D", "F"], reset_to_zero=["y32_ptr"])(
    _fused_decode_kernel
)


def fused_decode_ffn(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """y = (relu(x w_gate^T) * (x w_up^T)) @ w_down for M <= 64 tokens (arguments checked by the caller)."""
    M, D = x.shape
    F = w_gate.shape[0]
    if M > FUSED_MAX_M:
        raise ValueError(f"the fused decode kernel takes at most {FUSED_MAX_M} tokens, got {M}; use schedule='row'")
    y32 = torch.zeros((M, D), dtype=torch.float32, device=x.device)
    block_m = max(16, next_pow2(M))
    common = dict(D=D, BM=block_m, DOT_FP32=dot_in_fp32(x.dtype), PRECISION=dot_precision(x.dtype))
    if interpreting():
        bn = 32
        _fused_decode_kernel[(triton.cdiv(F, bn),)](
            x, w_gate, w_up, w_down, y32, M, F, block_m, BN=bn, BK=64, BD=64, **common
        )
    else:
        grid = lambda meta: (triton.cdiv(F, meta["BN"]),)  # noqa: E731
        _tuned[grid](x, w_gate, w_up, w_down, y32, M, F, block_m, **common)
    return y32.to(x.dtype)
