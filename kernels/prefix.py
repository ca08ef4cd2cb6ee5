"""The hot prefix's dense part: g * (x w_up[:P]^T) in one GEMM whose epilogue multiplies by the gate.

With units stored most-firing first (kernels.inference.unit_order), the first P hidden units carry
most of the positives (~58% at P = 512 of 5632 on paper-like activity) and are cheaper on tensor
cores than gathered row by row. Their gate values are already in the relu GEMM's dense h, so
y_hot = (h[:, :P] * (x w_up[:P]^T)) @ w_down[:P] needs no selection and no gathers. This kernel is
its first product with the multiply folded into the epilogue (fp32 tile times the gate, rounded once):
cuBLAS plus a separate elementwise pass over h's strided prefix cost 47 + 27 us at 16384 tokens and
378 + 214 us at 131072 (H200, P 512; kernels/NOTES.md round 12). The second product stays on cuBLAS,
as an addmm onto the row kernel's output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import dot_in_fp32, dot_precision, interpreting, next_pow2
from .gate import gate_tile_preact


@triton.jit
def _gated_up_kernel(x_ptr, w_ptr, h_ptr, out_ptr, M, P, M_BUCKET, F: tl.constexpr, D: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_M: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """out [M, P] = h[:, :P] * (x @ w[:P]^T); h [M, F] row-major. M_BUCKET only keys autotuning."""
    pid = tl.program_id(0)
    n_m = tl.cdiv(M, BLOCK_M)
    n_n = tl.cdiv(P, BLOCK_N)
    group = pid // (GROUP_M * n_n)  # grouped order: GROUP_M row tiles share their x rows in L2
    first_m = group * GROUP_M
    size_m = tl.minimum(n_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * n_n)) % size_m
    pid_n = (pid % (GROUP_M * n_n)) // size_m
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = gate_tile_preact(x_ptr, w_ptr, rows, cols, M, P, D, BLOCK_M, BLOCK_N, BLOCK_K, DOT_FP32, PRECISION)
    ok = (rows < M)[:, None] & (cols < P)[None, :]
    r64 = rows[:, None].to(tl.int64)
    g = tl.load(h_ptr + r64 * F + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + r64 * P + cols[None, :], (acc * g).to(out_ptr.dtype.element_ty), mask=ok)


def _configs():
    # (BLOCK_M, BLOCK_N, warps, stages), BLOCK_K 64; first = the interpreter's (small tiles run faster).
    table = [(64, 64, 4, 3), (128, 128, 8, 3), (128, 256, 8, 3), (128, 128, 4, 4), (128, 64, 4, 4)]
    return [
        triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": 64}, num_warps=w, num_stages=s)
        for m, n, w, s in table
    ]


_tuned = triton.autotune(configs=_configs(), key=["M_BUCKET", "P", "F", "D"])(_gated_up_kernel)


def gated_up(
    x: torch.Tensor, w_up: torch.Tensor, h: torch.Tensor, P: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """[M, P] in x's dtype = h[:, :P] * (x @ w_up[:P]^T), fp32 accumulation, one rounding. x [M, D],
    w_up [>= P, D], h [M, F >= P], all contiguous; D a multiple of 64. out: a contiguous [M, P] buffer
    of x's dtype to write (None: a new one)."""
    M, D = x.shape
    F = h.shape[1]
    if out is None:
        out = torch.empty(M, P, device=x.device, dtype=x.dtype)
    if M == 0 or P == 0:
        return out
    args = (x, w_up, h, out, M, P, min(next_pow2(M), 1 << 17))
    flags = dict(F=F, D=D, GROUP_M=8, DOT_FP32=dot_in_fp32(x.dtype), PRECISION=dot_precision(x.dtype))
    if interpreting():
        cfg = _configs()[0].kwargs
        grid = (triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(P, cfg["BLOCK_N"]),)
        _gated_up_kernel[grid](*args, **flags, **cfg)
    else:
        grid = lambda meta: (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(P, meta["BLOCK_N"]),)  # noqa: E731
        _tuned[grid](*args, **flags)
    return out
