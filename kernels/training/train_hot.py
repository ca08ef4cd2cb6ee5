"""Elementwise passes of the training op's hot units ([M, K] dense blocks), one kernel each.

Forward: h = g * u (x's dtype, as a dense FFN rounds it), plus per row sum|h|, which the op needs
for its L1 term (torch ops and a reduction otherwise, ~0.1 ms at 16384 x 1024 on an H200).
Backward: dh = (dy w_down^T)[hot] + grad_l1 / M * sign(h); d_gate = dh * u on the ReLU mask, d_up = dh * g,
h recomputed; all stored in x's dtype for the cuBLAS GEMMs that follow (six fp32 torch ops over
[M, K] otherwise, ~0.27 ms at 16384 x 1024).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._common import cdiv, interpreting, next_pow2
from .._launch import fast


@triton.jit
def _hot_forward_kernel(g_ptr, u_ptr, h_ptr, l1_ptr, K: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    acc_l1 = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        ok = ks < K
        g = tl.load(g_ptr + row * K + ks, mask=ok, other=0.0)
        u = tl.load(u_ptr + row * K + ks, mask=ok, other=0.0)
        h = (g.to(tl.float32) * u.to(tl.float32)).to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + row * K + ks, h, mask=ok)
        acc_l1 += tl.abs(h.to(tl.float32))
    tl.store(l1_ptr + row, tl.sum(acc_l1, axis=0))


_HOT_FORWARD = fast(_hot_forward_kernel)


def hot_forward(
    g_hot: torch.Tensor, u_hot: torch.Tensor, out: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h_hot [M, K] in g's dtype, written into `out` when given; sum|h| per row fp32 [M])."""
    M, K = g_hot.shape
    h = torch.empty_like(g_hot) if out is None else out
    l1_rows = torch.empty(M, dtype=torch.float32, device=g_hot.device)
    block = min(1024, next_pow2(K)) if not interpreting() else min(64, next_pow2(K))
    _HOT_FORWARD[(M,)](g_hot, u_hot, h, l1_rows, K=K, BLOCK_K=block, num_warps=4)
    return h, l1_rows


@triton.jit
def _hot_backward_kernel(dhd_ptr, g_ptr, u_ptr, l1_ptr, M, dgu_ptr, h_ptr, n, K: tl.constexpr,
                         BLOCK: tl.constexpr):  # fmt: skip
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    dg_off = offs + (offs // K) * K  # element (r, k) of d_gate at r * 2K + k; d_up K further
    g = tl.load(g_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    h = (g * u).to(h_ptr.dtype.element_ty)  # as the forward rounded it
    hf = h.to(tl.float32)
    sign = tl.where(hf > 0, 1.0, tl.where(hf < 0, -1.0, 0.0))
    dh = (
        tl.load(dhd_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        + (tl.load(l1_ptr).to(tl.float32) / M) * sign
    )
    tl.store(dgu_ptr + dg_off, tl.where(g > 0, dh * u, 0.0).to(dgu_ptr.dtype.element_ty), mask=ok)
    tl.store(dgu_ptr + dg_off + K, (dh * g).to(dgu_ptr.dtype.element_ty), mask=ok)
    tl.store(h_ptr + offs, h, mask=ok)


_HOT_BACKWARD = fast(_hot_backward_kernel)


def hot_backward(
    dh_dense: torch.Tensor, g_hot: torch.Tensor, u_hot: torch.Tensor, grad_l1: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(d_gu [M, 2K] = [d_gate | d_up], h [M, K]) in g's dtype from dh_dense = dy @ w_down[hot]^T and
    the upstream gradient of l1 = sum |h| / M (fp32 0-dim device tensor, divided by M = g_hot's rows on
    the device: no host sync). d_gate and d_up side by side, so that dx and
    the two weight gradients each take one GEMM over both (against [w_gate[hot]; w_up[hot]])."""
    M, K = g_hot.shape
    d_gu = g_hot.new_empty(M, 2 * K)
    h = torch.empty_like(g_hot)
    n = g_hot.numel()
    block = 1024 if not interpreting() else 256
    _HOT_BACKWARD[(cdiv(n, block),)](
        dh_dense, g_hot, u_hot, grad_l1.reshape(1), M, d_gu, h, n, K=K, BLOCK=block, num_warps=4
    )
    return d_gu, h


@triton.jit
def _scatter_hot_rows_kernel(idx_ptr, gu_ptr, d_ptr, out_g_ptr, out_u_ptr, out_d_ptr, K, D: tl.constexpr,
                             BLOCK: tl.constexpr):  # fmt: skip
    r = tl.program_id(0)
    ds = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = ds < D
    dst = tl.load(idx_ptr + r) * D + ds
    src = r.to(tl.int64) * D + ds
    tl.store(out_g_ptr + dst, tl.load(gu_ptr + src, mask=ok), mask=ok)
    tl.store(out_u_ptr + dst, tl.load(gu_ptr + K * D + src, mask=ok), mask=ok)
    tl.store(out_d_ptr + dst, tl.load(d_ptr + src, mask=ok), mask=ok)


_SCATTER_HOT_ROWS = fast(_scatter_hot_rows_kernel)


def scatter_hot_rows(
    hot_idx: torch.Tensor, dw_gu: torch.Tensor, dw_down_hot: torch.Tensor, dw_gate: torch.Tensor,
    dw_up: torch.Tensor, dw_down: torch.Tensor,
) -> None:  # fmt: skip
    """dw_gate[hot_idx] = dw_gu[:K], dw_up[hot_idx] = dw_gu[K:], dw_down[hot_idx] = dw_down_hot: the hot
    units' weight-gradient rows in one launch (three index_copy_ otherwise). All contiguous, one dtype."""
    K, D = dw_down_hot.shape
    block = min(1024, next_pow2(D)) if not interpreting() else min(64, next_pow2(D))
    _SCATTER_HOT_ROWS[(K, cdiv(D, block))](
        hot_idx, dw_gu, dw_down_hot, dw_gate, dw_up, dw_down, K, D=D, BLOCK=block, num_warps=4
    )
