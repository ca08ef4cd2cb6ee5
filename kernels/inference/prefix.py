"""The hot prefix's dense part: g * (x w_up[:P]^T) in one GEMM whose epilogue multiplies by the gate.

With units stored most-firing first (kernels.inference.inference.unit_order), the first P hidden units carry
most of the positives (~58% at P = 512 of 5632 on paper-like activity) and are cheaper on tensor
cores than gathered row by row. Their gate values are already in the relu GEMM's dense h, so
y_hot = (h[:, :P] * (x w_up[:P]^T)) @ w_down[:P] needs no selection and no gathers. This kernel is
its first product with the multiply folded into the epilogue (fp32 tile times the gate, rounded once),
through TMA descriptors on Hopper (pointer loads elsewhere). Graph-replayed on an H200 at P 512: 60 us
at 16384 tokens and 485 us at 131072, where cuBLAS plus a separate pass over h's strided prefix takes
74 and 592 us, and pointer loads take 68 and 542 us (NOTES round 13). The second product
stays on cuBLAS, as an addmm onto the row kernel's output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._common import autotune, dot_in_fp32, dot_precision, interpreting, next_pow2, tma_ready
from ..gate_gemm import _gate_tile_tma, _grouped_tile, gate_tile_preact


@triton.jit
def _gated_up_kernel(x_ptr, w_ptr, h_ptr, out_ptr, M, P, M_BUCKET, F: tl.constexpr, D: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_M: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """out [M, P] = h[:, :P] * (x @ w[:P]^T); h [M, F] row-major. M_BUCKET only keys autotuning."""
    pid_m, pid_n = _grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(P, BLOCK_N), GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = gate_tile_preact(x_ptr, w_ptr, rows, cols, M, P, D, BLOCK_M, BLOCK_N, BLOCK_K, DOT_FP32, PRECISION)
    ok = (rows < M)[:, None] & (cols < P)[None, :]
    r64 = rows[:, None].to(tl.int64)
    g = tl.load(h_ptr + r64 * F + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + r64 * P + cols[None, :], (acc * g).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _gated_up_tma_kernel(x_desc, w_desc, h_desc, out_desc, M, P, M_BUCKET, D: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         GROUP_M: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """_gated_up_kernel through TMA descriptors (Hopper+): x, w_up and h's tile come in by TMA and the
    product leaves by a TMA store clipped to [M, P] (w_up rows and h columns at or past P only feed
    output columns past P, which are not stored)."""
    pid_m, pid_n = _grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(P, BLOCK_N), GROUP_M)
    off_m, off_n = pid_m * BLOCK_M, pid_n * BLOCK_N
    acc = _gate_tile_tma(x_desc, w_desc, off_m, off_n, D, BLOCK_M, BLOCK_N, BLOCK_K, DOT_FP32, PRECISION)
    g = h_desc.load([off_m, off_n]).to(tl.float32)
    out_desc.store([off_m, off_n], (acc * g).to(out_desc.dtype))


def _configs(pre_hook=None):
    # (BLOCK_M, BLOCK_N, warps, stages), BLOCK_K 64; first = the interpreter's (small tiles run faster).
    table = [(64, 64, 4, 3), (128, 128, 8, 3), (128, 256, 8, 3), (128, 128, 4, 4), (128, 64, 4, 4)]
    if pre_hook is not None:  # TMA: deeper pipelines fit (operands in shared memory only)
        table += [(128, 128, 8, 4), (128, 256, 8, 4), (128, 128, 4, 5)]
    return [
        triton.Config(
            {"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": 64}, num_warps=w, num_stages=s, pre_hook=pre_hook
        )
        for m, n, w, s in table
    ]


def _set_blocks(nargs):
    """Autotune pre-hook: the descriptors carry the config's block shapes."""
    bm, bn, bk = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["BLOCK_K"]
    nargs["x_desc"].block_shape = [bm, bk]
    nargs["w_desc"].block_shape = [bn, bk]
    nargs["h_desc"].block_shape = [bm, bn]
    nargs["out_desc"].block_shape = [bm, bn]


_CONFIGS, _TMA_CONFIGS = (
    _configs(),
    _configs(_set_blocks),
)  # built once: the launcher reads the first's blocks
_tuned = autotune(configs=_CONFIGS, key=["M_BUCKET", "P", "F", "D"])(_gated_up_kernel)
_tuned_tma = autotune(configs=_TMA_CONFIGS, key=["M_BUCKET", "P", "D"])(_gated_up_tma_kernel)
_loads = {"loads": None}


def set_gated_up_loads(loads: str | None) -> None:
    """Benchmark switch: "tma" (descriptors, Hopper+), "ptr" (pointer loads, any GPU) or None (TMA where
    the GPU and the operands' alignment allow it)."""
    if loads not in (None, "tma", "ptr"):
        raise ValueError(f"gated_up loads={loads!r} must be 'tma', 'ptr' or None")
    _loads["loads"] = loads


def _use_tma(*tensors: torch.Tensor) -> bool:
    if _loads["loads"] is not None:
        return _loads["loads"] == "tma"
    return tma_ready(*tensors)


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
    m_bucket = min(next_pow2(M), 1 << 17)
    flags = dict(D=D, GROUP_M=8, DOT_FP32=dot_in_fp32(x.dtype), PRECISION=dot_precision(x.dtype))
    grid = lambda meta: (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(P, meta["BLOCK_N"]),)  # noqa: E731
    if _use_tma(x, w_up, h, out):
        from triton.tools.tensor_descriptor import TensorDescriptor

        cfg = _TMA_CONFIGS[0].kwargs  # placeholders: the pre-hook sets each config's blocks
        bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
        descs = (
            TensorDescriptor.from_tensor(x, [bm, bk]),
            TensorDescriptor.from_tensor(w_up, [bn, bk]),
            TensorDescriptor.from_tensor(h, [bm, bn]),
            TensorDescriptor.from_tensor(out, [bm, bn]),
        )
        if interpreting():
            _gated_up_tma_kernel[grid(cfg)](*descs, M, P, m_bucket, **flags, **cfg)
        else:
            _tuned_tma[grid](*descs, M, P, m_bucket, **flags)
        return out
    args = (x, w_up, h, out, M, P, m_bucket)
    if interpreting():
        cfg = _CONFIGS[0].kwargs
        _gated_up_kernel[grid(cfg)](*args, F=F, **flags, **cfg)
    else:
        _tuned[grid](*args, F=F, **flags)
    return out
