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

from ._common import interpreting, next_pow2
from .gate import _gate_tile_tma, _grouped_tile


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


def hot_forward(g_hot: torch.Tensor, u_hot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(h_hot [M, K] in g's dtype, sum|h| per row fp32 [M])."""
    M, K = g_hot.shape
    h = torch.empty_like(g_hot)
    l1_rows = torch.empty(M, dtype=torch.float32, device=g_hot.device)
    block = min(1024, next_pow2(K)) if not interpreting() else min(64, next_pow2(K))
    _hot_forward_kernel[(M,)](g_hot, u_hot, h, l1_rows, K=K, BLOCK_K=block, num_warps=4)
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
    _hot_backward_kernel[(triton.cdiv(n, block),)](
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


def scatter_hot_rows(
    hot_idx: torch.Tensor, dw_gu: torch.Tensor, dw_down_hot: torch.Tensor, dw_gate: torch.Tensor,
    dw_up: torch.Tensor, dw_down: torch.Tensor,
) -> None:  # fmt: skip
    """dw_gate[hot_idx] = dw_gu[:K], dw_up[hot_idx] = dw_gu[K:], dw_down[hot_idx] = dw_down_hot: the hot
    units' weight-gradient rows in one launch (three index_copy_ otherwise). All contiguous, one dtype."""
    K, D = dw_down_hot.shape
    block = min(1024, next_pow2(D)) if not interpreting() else min(64, next_pow2(D))
    _scatter_hot_rows_kernel[(K, triton.cdiv(D, block))](
        hot_idx, dw_gu, dw_down_hot, dw_gate, dw_up, dw_down, K, D=D, BLOCK=block, num_warps=4
    )


# The hot units' first GEMM of each pass with the elementwise pass above in its epilogue: one
# persistent kernel (the gate GEMM's TMA main loop, kernels/gate.py) per pass instead of a cuBLAS GEMM
# whose [M, K] output the elementwise kernel reads back.
#   forward:  acc = x w_up[hot]^T -> u (stored, x's dtype), h = g * u, per-tile row sums of |h|
#   backward: acc = dy w_down[hot]^T -> dh (rounded to x's dtype, as the unfused GEMM's output was)
#             + grad_l1 / M * sign(h) -> d_gate = dh * u on the ReLU mask, d_up = dh * g, h
# Same arithmetic and rounding points as hot_forward / hot_backward on a cuBLAS GEMM's output.
L1_COLS = tl.constexpr(64)  # columns per partial row sum of the fused forward (divides every BLOCK_N)


@triton.jit
def _hot_gemm_kernel(
    a_desc, w_desc, g_ptr, u_ptr, out_ptr, h_ptr, l1_ptr, M, K, M_BUCKET, D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_PROGS: tl.constexpr, FLATTEN: tl.constexpr, WHILE_LOOP: tl.constexpr, DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr, BACKWARD: tl.constexpr, I64: tl.constexpr,
):  # fmt: skip
    """a [M, D] @ w[K, D]^T per [BLOCK_M, BLOCK_N] tile, then the pass's epilogue (see above). Forward:
    out = u [M, K], l1 = row sums of |h| over 64-column blocks, fp32 [cdiv(K, 64), M]. Backward: u is read, out = d_gu
    [M, 2K], l1 = grad_l1 (fp32 [1]). h [M, K] both ways. M_BUCKET only keys autotuning."""
    n_m = tl.cdiv(M, BLOCK_M)
    n_n = tl.cdiv(K, BLOCK_N)
    n_tiles = n_m * n_n
    if WHILE_LOOP:
        tile_id = tl.program_id(0)
        while tile_id < n_tiles:
            pid_m, pid_n = _grouped_tile(tile_id, n_m, n_n, GROUP_M)
            acc = _gate_tile_tma(a_desc, w_desc, pid_m * BLOCK_M, pid_n * BLOCK_N, D, BLOCK_M, BLOCK_N, BLOCK_K,
                                 DOT_FP32, PRECISION)  # fmt: skip
            _hot_epilogue(
                acc, g_ptr, u_ptr, out_ptr, h_ptr, l1_ptr, pid_m, pid_n, M, K, BLOCK_M, BLOCK_N, BACKWARD, I64
            )
            tile_id += NUM_PROGS
    else:
        tile_c = tl.program_id(0) - NUM_PROGS  # the epilogue's own tile counter (see gate.py)
        for tile_id in tl.range(tl.program_id(0), n_tiles, NUM_PROGS, flatten=FLATTEN):
            pid_m, pid_n = _grouped_tile(tile_id, n_m, n_n, GROUP_M)
            acc = _gate_tile_tma(a_desc, w_desc, pid_m * BLOCK_M, pid_n * BLOCK_N, D, BLOCK_M, BLOCK_N, BLOCK_K,
                                 DOT_FP32, PRECISION)  # fmt: skip
            tile_c += NUM_PROGS
            pid_m, pid_n = _grouped_tile(tile_c, n_m, n_n, GROUP_M)
            _hot_epilogue(
                acc, g_ptr, u_ptr, out_ptr, h_ptr, l1_ptr, pid_m, pid_n, M, K, BLOCK_M, BLOCK_N, BACKWARD, I64
            )


@triton.jit
def _hot_epilogue(acc, g_ptr, u_ptr, out_ptr, h_ptr, l1_ptr, pid_m, pid_n, M, K, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BACKWARD: tl.constexpr, I64: tl.constexpr):  # fmt: skip
    """The tile's epilogue in two column halves (half the live registers of a whole tile)."""
    a0, a1 = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
    off_n = pid_n * BLOCK_N
    _hot_epilogue_part(a0, g_ptr, u_ptr, out_ptr, h_ptr, l1_ptr, pid_m, off_n, M, K, BLOCK_M, BLOCK_N // 2,
                       BACKWARD, I64)  # fmt: skip
    _hot_epilogue_part(a1, g_ptr, u_ptr, out_ptr, h_ptr, l1_ptr, pid_m, off_n + BLOCK_N // 2, M, K, BLOCK_M,
                       BLOCK_N // 2, BACKWARD, I64)  # fmt: skip


@triton.jit
def _hot_epilogue_part(acc, g_ptr, u_ptr, out_ptr, h_ptr, l1_ptr, pid_m, off_n, M, K, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BACKWARD: tl.constexpr, I64: tl.constexpr):  # fmt: skip
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = off_n + tl.arange(0, BLOCK_N)
    ok = (rows < M)[:, None] & (cols < K)[None, :]
    r = rows.to(tl.int64) if I64 else rows  # int32 offsets unless [M, 2K] passes 2^31 elements
    offs = r[:, None] * K + cols[None, :]
    dt = h_ptr.dtype.element_ty
    g = tl.load(g_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    if BACKWARD:
        u = tl.load(u_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        h = (g * u).to(dt)  # as the forward rounded it
        tl.store(h_ptr + offs, h, mask=ok)
        hf = h.to(tl.float32)
        sign = tl.where(hf > 0, 1.0, tl.where(hf < 0, -1.0, 0.0))
        dh = acc.to(dt).to(tl.float32) + (tl.load(l1_ptr).to(tl.float32) / M) * sign
        gu = offs + r[:, None] * K  # (r, k) of [M, 2K]: d_gate; d_up K further
        tl.store(out_ptr + gu, tl.where(g > 0, dh * u, 0.0).to(dt), mask=ok)
        tl.store(out_ptr + gu + K, (dh * g).to(dt), mask=ok)
    else:
        u = acc.to(dt)
        tl.store(out_ptr + offs, u, mask=ok)
        h = (g * u.to(tl.float32)).to(dt)
        tl.store(h_ptr + offs, h, mask=ok)
        # sum|h| per row over each 64-column block: the partials' layout (and so the sum's order) does
        # not depend on the config's BLOCK_N
        tl.static_assert(
            (BLOCK_N // L1_COLS) * L1_COLS == BLOCK_N, "half a tile must hold whole 64-column blocks"
        )
        part = tl.sum(tl.reshape(tl.abs(h.to(tl.float32)), (BLOCK_M, BLOCK_N // L1_COLS, L1_COLS)), axis=2)
        blk = off_n // L1_COLS + tl.arange(0, BLOCK_N // L1_COLS)
        part_ok = (rows < M)[:, None] & (blk < tl.cdiv(K, L1_COLS))[None, :]
        tl.store(l1_ptr + blk[None, :] * M + rows[:, None], part, mask=part_ok)


def _hot_gemm_set_blocks(nargs):
    """Autotune pre-hook: the descriptors carry the config's block shapes."""
    nargs["a_desc"].block_shape = [nargs["BLOCK_M"], nargs["BLOCK_K"]]
    nargs["w_desc"].block_shape = [nargs["BLOCK_N"], nargs["BLOCK_K"]]


# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, flatten), compiled for sm_90 without a GPU: 246-255
# registers, at most 32 bytes of spill (the backward with a flattened loop); 128x256 tiles spill 0.6-2.3
# KB, 4 warps 0.5-2.5 KB. One program an SM either way (persistent; 115-180 KB of shared memory).
HOT_GEMM_CONFIGS = [
    (128, 128, 64, 8, 4, True),
    (128, 128, 64, 8, 4, False),
    (128, 128, 64, 8, 5, True),
    (128, 128, 64, 8, 5, False),
]
_hot_gemm_tuned: dict = {}


def fused_hot_gemm_ok(a: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the fused kernel takes a [M, D] @ w [K, D]^T: TMA needs 16-byte aligned rows (and bases)."""
    align = 16 // a.element_size()
    return (
        a.dtype in (torch.bfloat16, torch.float16, torch.float32) and a.dtype == w.dtype
        and a.shape[1] % align == 0 and a.is_contiguous() and w.is_contiguous()
        and a.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0
    )  # fmt: skip


def _hot_gemm(a, w, g, u, out, h, l1, backward: bool) -> None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    from ._common import cdiv, dot_in_fp32, dot_precision

    M, D = a.shape
    K = w.shape[0]
    flags = dict(
        DOT_FP32=dot_in_fp32(a.dtype), PRECISION=dot_precision(a.dtype), BACKWARD=backward,
        I64=M * 2 * K >= 2**31,
    )  # fmt: skip
    if interpreting():
        bm, bn, bk = 32, 128, 64  # two 64-column halves: one l1 partial block each
        descs = [TensorDescriptor.from_tensor(t, blk) for t, blk in ((a, [bm, bk]), (w, [bn, bk]))]
        n_progs = 3  # fewer programs than tiles: every program walks several
        _hot_gemm_kernel[(n_progs,)](
            *descs, g, u, out, h, l1, M, K, 0, D=D, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=4,
            NUM_PROGS=n_progs, FLATTEN=False, WHILE_LOOP=True, **flags,
        )  # fmt: skip
        return
    n_sm = torch.cuda.get_device_properties(a.device).multi_processor_count
    descs = [TensorDescriptor.from_tensor(t, [64, 64]) for t in (a, w)]  # blocks set per config
    if "k" not in _hot_gemm_tuned:
        configs = [
            triton.Config(
                dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, FLATTEN=fl),
                num_warps=wp,
                num_stages=st,
                pre_hook=_hot_gemm_set_blocks,
            )  # fmt: skip
            for bm, bn, bk, wp, st, fl in HOT_GEMM_CONFIGS
        ]
        # Every config rewrites all of out (u, d_gu), h and the forward's l1 partials (fixed 64-column
        # blocks), so autotuning's trial runs leave nothing stale.
        _hot_gemm_tuned["k"] = triton.autotune(configs=configs, key=["M_BUCKET", "K", "D", "BACKWARD"])(
            _hot_gemm_kernel
        )

    def grid(meta):
        return (min(n_sm, cdiv(M, meta["BLOCK_M"]) * cdiv(K, meta["BLOCK_N"])),)

    _hot_gemm_tuned["k"][grid](
        *descs, g, u, out, h, l1, M, K, min(next_pow2(M), 1 << 17), D=D, GROUP_M=8, NUM_PROGS=n_sm,
        WHILE_LOOP=False, **flags,
    )  # fmt: skip


def hot_forward_gemm(x: torch.Tensor, w_up_hot: torch.Tensor, g_hot: torch.Tensor, u_hot: torch.Tensor):
    """u_hot[:] = x @ w_up_hot^T and (h_hot = g * u [M, K] in x's dtype, sum|h| per row fp32 [M]) from
    one fused GEMM (fused_hot_gemm_ok must hold), as hot_forward on a cuBLAS GEMM's output computes it."""
    M, K = g_hot.shape
    h = torch.empty_like(g_hot)
    l1_part = torch.empty(triton.cdiv(K, 64), M, dtype=torch.float32, device=x.device)
    _hot_gemm(x, w_up_hot, g_hot, g_hot, u_hot, h, l1_part, backward=False)
    return h, l1_part.sum(0)


def hot_backward_gemm(
    dy: torch.Tensor,
    w_down_hot: torch.Tensor,
    g_hot: torch.Tensor,
    u_hot: torch.Tensor,
    grad_l1: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """hot_backward(dy @ w_down_hot^T, g_hot, u_hot, grad_l1) in one fused GEMM (fused_hot_gemm_ok must
    hold): (d_gu [M, 2K] = [d_gate | d_up], h [M, K])."""
    M, K = g_hot.shape
    d_gu = g_hot.new_empty(M, 2 * K)
    h = torch.empty_like(g_hot)
    _hot_gemm(dy, w_down_hot, g_hot, u_hot, d_gu, h, grad_l1.reshape(1), backward=True)
    return d_gu, h
