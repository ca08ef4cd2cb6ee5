"""The two sparse primitives every product of the TwELL training op reduces to.

The forward and backward of the ReLU-gated FFN, restricted to the activation pattern, are six
sparse products plus elementwise work. Each product is one of two shapes:

* sampled dot: `out[e] = A[rows[e]] . B[cols[e]]` for every stored entry e (u = x . w_up at the
  pattern, dh = dy . w_down at the pattern). Entry-parallel, so heavy rows do not serialise.
* segment gather-axpy: `out[s] = sum_{e in segment s} coef[e] * src[gidx[e]]`. Row segments
  (CSR) give y = h w_down and dx = dg w_gate + du w_up; column segments (CSC) give the weight
  gradients dW = coef^T x. Deterministic: every output row is summed by one program, no atomics.

Both run on CUDA cores: at ~0.5% density a tensor-core tile would be >99% zeros. They are bound by
the bytes of the gathered rows (see kernels/NOTES_TRAIN.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import interpreting

# Segment modes (constexpr): which outputs one pass over the gathered rows produces.
ONE = 0  # out0 = sum c0 * src0[g]
SUM2 = 1  # out0 = sum c0 * src0[g] + c1 * src1[g]         (dx: two weight matrices, one output)
SPLIT2 = 2  # out0 = sum c0 * src0[g], out1 = sum c1 * src0[g]  (dW_gate, dW_up share the x rows)
SPLIT3 = 3  # SPLIT2 plus out2 = sum c2 * src1[g]             (all three weight gradients at once)


def _configs(block_e: tuple[int, ...], block_d: tuple[int, ...], warps: tuple[int, ...]):
    return [
        triton.Config({"BLOCK_E": e, "BLOCK_D": d}, num_warps=w)
        for e in block_e
        for d in block_d
        for w in warps
    ]


def _tuned(configs, key):
    """Autotune on a GPU; under the interpreter take the first config (timing it would be meaningless)."""

    def wrap(kernel):
        if interpreting():
            return triton.heuristics({name: (lambda _a, v=v: v) for name, v in configs[0].kwargs.items()})(
                kernel
            )
        return triton.autotune(configs=configs, key=key)(kernel)

    return wrap


@_tuned(_configs((16, 32), (128, 256), (4, 8)), key=["D"])
@triton.jit
def _sampled_dot_kernel(
    rows_ptr, cols_ptr, a_ptr, b_ptr, out_ptr, nnz, stride_a, stride_b,
    D: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    offs_e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    mask_e = offs_e < nnz
    rows = tl.load(rows_ptr + offs_e, mask=mask_e, other=0).to(tl.int64)
    cols = tl.load(cols_ptr + offs_e, mask=mask_e, other=0).to(tl.int64)
    acc = tl.zeros([BLOCK_E], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        mask = mask_e[:, None] & (offs_d[None, :] < D)
        a = tl.load(a_ptr + rows[:, None] * stride_a + offs_d[None, :], mask=mask, other=0.0)
        b = tl.load(b_ptr + cols[:, None] * stride_b + offs_d[None, :], mask=mask, other=0.0)
        acc += tl.sum(a.to(tl.float32) * b.to(tl.float32), axis=1)
    tl.store(out_ptr + offs_e, acc, mask=mask_e)


def sampled_dot(rows: torch.Tensor, cols: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """fp32 [nnz]: `a[rows[e]] . b[cols[e]]`; a [M, D] and b [F, D] row-major (unit last stride)."""
    nnz, D = rows.numel(), a.shape[1]
    out = torch.empty(nnz, device=a.device, dtype=torch.float32)
    if nnz:
        grid = lambda meta: (triton.cdiv(nnz, meta["BLOCK_E"]),)
        _sampled_dot_kernel[grid](rows, cols, a, b, out, nnz, a.stride(0), b.stride(0), D=D)
    return out


@triton.jit
def _segment_step(
    e0, end, acc0, acc1, acc2, gidx_ptr, c0_ptr, c1_ptr, c2_ptr, s0_ptr, s1_ptr, offs_d, mask_d,
    stride_s0, stride_s1, MODE: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    """Entries e0 .. e0 + BLOCK_E of one segment: gather their source rows, scale, accumulate."""
    offs_e = e0 + tl.arange(0, BLOCK_E)
    mask_e = offs_e < end
    mask = mask_e[:, None] & mask_d[None, :]
    g = tl.load(gidx_ptr + offs_e, mask=mask_e, other=0).to(tl.int64)
    c0 = tl.load(c0_ptr + offs_e, mask=mask_e, other=0.0).to(tl.float32)
    t0 = tl.load(s0_ptr + g[:, None] * stride_s0 + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    acc0 += tl.sum(c0[:, None] * t0, axis=0)
    if MODE == 1:
        c1 = tl.load(c1_ptr + offs_e, mask=mask_e, other=0.0).to(tl.float32)
        t1 = tl.load(s1_ptr + g[:, None] * stride_s1 + offs_d[None, :], mask=mask, other=0.0)
        acc0 += tl.sum(c1[:, None] * t1.to(tl.float32), axis=0)
    if MODE >= 2:
        c1 = tl.load(c1_ptr + offs_e, mask=mask_e, other=0.0).to(tl.float32)
        acc1 += tl.sum(c1[:, None] * t0, axis=0)
    if MODE == 3:
        c2 = tl.load(c2_ptr + offs_e, mask=mask_e, other=0.0).to(tl.float32)
        t2 = tl.load(s1_ptr + g[:, None] * stride_s1 + offs_d[None, :], mask=mask, other=0.0)
        acc2 += tl.sum(c2[:, None] * t2.to(tl.float32), axis=0)
    return acc0, acc1, acc2


@_tuned(_configs((16, 32), (128, 256), (4, 8)), key=["D", "MODE"])
@triton.jit
def _segment_axpy_kernel(
    seg_ptr, gidx_ptr, c0_ptr, c1_ptr, c2_ptr, s0_ptr, s1_ptr, o0_ptr, o1_ptr, o2_ptr,
    stride_s0, stride_s1, stride_o,
    D: tl.constexpr, MODE: tl.constexpr, WHILE_LOOP: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    seg = tl.program_id(0)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    start = tl.load(seg_ptr + seg)
    end = tl.load(seg_ptr + seg + 1)
    acc0 = tl.zeros([BLOCK_D], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_D], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_D], dtype=tl.float32)
    if WHILE_LOOP:
        # The interpreter (with numpy >= 2) cannot run range() over loaded bounds; a while loop works.
        e0 = start
        while e0 < end:
            acc0, acc1, acc2 = _segment_step(
                e0, end, acc0, acc1, acc2, gidx_ptr, c0_ptr, c1_ptr, c2_ptr, s0_ptr, s1_ptr,
                offs_d, mask_d, stride_s0, stride_s1, MODE, BLOCK_E,
            )  # fmt: skip
            e0 += BLOCK_E
    else:
        for e0 in range(start, end, BLOCK_E):
            acc0, acc1, acc2 = _segment_step(
                e0, end, acc0, acc1, acc2, gidx_ptr, c0_ptr, c1_ptr, c2_ptr, s0_ptr, s1_ptr,
                offs_d, mask_d, stride_s0, stride_s1, MODE, BLOCK_E,
            )  # fmt: skip
    out_offs = seg.to(tl.int64) * stride_o + offs_d
    tl.store(o0_ptr + out_offs, acc0.to(o0_ptr.dtype.element_ty), mask=mask_d)
    if MODE >= 2:
        tl.store(o1_ptr + out_offs, acc1.to(o1_ptr.dtype.element_ty), mask=mask_d)
    if MODE == 3:
        tl.store(o2_ptr + out_offs, acc2.to(o2_ptr.dtype.element_ty), mask=mask_d)


def segment_axpy(
    seg_ptr: torch.Tensor,
    gidx: torch.Tensor,
    coefs: tuple[torch.Tensor, ...],
    sources: tuple[torch.Tensor, ...],
    outs: tuple[torch.Tensor, ...],
    mode: int,
) -> None:
    """Fill `outs` ([n_seg, D] each, fully written) with segment sums of gathered source rows.

    seg_ptr int32 [n_seg + 1] (segment s = entries seg_ptr[s]:seg_ptr[s+1]); gidx [nnz] the source
    row of each entry; coefs fp32 [nnz] each. The number of coefs/sources/outs follows `mode`.
    """
    n_seg, D = outs[0].shape
    if n_seg == 0:
        return
    c = coefs + (coefs[0],) * (3 - len(coefs))
    s = sources + (sources[0],) * (2 - len(sources))
    o = outs + (outs[0],) * (3 - len(outs))
    assert all(t.stride(1) == 1 for t in s + o) and len({t.stride(0) for t in o}) == 1
    grid = lambda meta: (n_seg, triton.cdiv(D, meta["BLOCK_D"]))
    _segment_axpy_kernel[grid](
        seg_ptr, gidx, c[0], c[1], c[2], s[0], s[1], o[0], o[1], o[2],
        s[0].stride(0), s[1].stride(0), o[0].stride(0), D=D, MODE=mode, WHILE_LOOP=interpreting(),
    )  # fmt: skip
