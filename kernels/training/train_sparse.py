"""The entry- and column-parallel sparse products of the TwELL training backward.

(The row-parallel ones, u and y in the forward and dx in the backward, are whole-row kernels in
train_rowfwd.py.)

* entry grads: the sampled dot `dh[e] = dy[rows[e]] . w_down[cols[e]]` for every stored entry e,
  with the per-entry gradients in its epilogue. Entry-parallel, so heavy rows do not serialise.
* segment gather-axpy over column segments (CSC): `out[s] = sum_{e in segment s} coef[e] *
  src[gidx[e]]` gives the weight gradients dW = coef^T x (and h^T dy). Deterministic: each output
  row is summed in a fixed order (long columns in chunks whose partials a second kernel adds in
  order), no atomics.

Both run on CUDA cores: at ~0.5% density a tensor-core tile would be >99% zeros. They are bound by
the bytes of the gathered rows (see docs/KERNELS.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._common import autotune, cdiv, interpreting
from .._launch import fast

# Segment modes (constexpr): which outputs one pass over the gathered rows produces.
ONE = 0  # out0 = sum c0 * src0[g]                              (dW_down alone)
SPLIT2 = 2  # out0 = sum c0 * src0[g], out1 = sum c1 * src0[g]  (dW_gate, dW_up share the x rows)
SPLIT3 = 3  # SPLIT2 plus out2 = sum c2 * src1[g]             (all three weight gradients at once)


def _configs(shapes: tuple[tuple[int, int, int], ...]):
    return [triton.Config({"BLOCK_E": e, "BLOCK_D": d}, num_warps=w) for e, d, w in shapes]


# (BLOCK_E, BLOCK_D, warps) candidates that compile for sm_90 without register spills (checked with
# cuobjdump --dump-resource-usage); small tiles keep more warps resident to hide the gather latency.
# (8, 512, 8): 16-byte loads along D (8 bf16 a thread), a whole 1 KB row slice per warp per step.
# (2-4, 1024-2048, 8): whole 2-4 KB rows per step and few D slices per item — the shape of the row
# kernels that gather at ~4 TB/s, for passes bound by per-item cost (round 7; not yet spill-checked).
_SHAPES = (
    (16, 128, 4), (8, 256, 4), (16, 256, 4), (16, 256, 8), (32, 128, 8), (8, 512, 8),
    (4, 1024, 8), (2, 2048, 8),
)  # fmt: skip


def _tuned(configs, key):
    """Autotune on a GPU; under the interpreter take the first config (timing it would be meaningless)."""

    def wrap(kernel):
        if interpreting():
            return triton.heuristics({name: (lambda _a, v=v: v) for name, v in configs[0].kwargs.items()})(
                kernel
            )
        return autotune(configs=configs, key=key)(kernel)

    return wrap


@_tuned(_configs(_SHAPES), key=["D"])
@triton.jit(do_not_specialize=["nnz"])
def _entry_grads_kernel(
    rows_ptr, cols_ptr, dy_ptr, wd_ptr, d_gate_ptr, nnz, stride_dy, stride_wd, gate_ptr, up_ptr, l1_ptr, M,
    d_up_ptr, h_ptr, D: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    offs_e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    mask_e = offs_e < nnz
    # Every entry has g > 0 (the ReLU mask); a zero gate is an unused slot of a fixed-capacity list
    # (CUDA graphs: column past the last unit, u never written): it loads nothing and gives zeros.
    g = tl.load(gate_ptr + offs_e, mask=mask_e, other=0.0).to(tl.float32)
    live = g > 0
    mask_e = mask_e & live
    rows = tl.load(rows_ptr + offs_e, mask=mask_e, other=0).to(tl.int64)
    cols = tl.load(cols_ptr + offs_e, mask=mask_e, other=0).to(tl.int64)
    # Elementwise fp32 accumulation, one cross-thread reduction at the end (not one per D block).
    acc = tl.zeros([BLOCK_E, BLOCK_D], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        mask = mask_e[:, None] & (offs_d[None, :] < D)
        a = tl.load(dy_ptr + rows[:, None] * stride_dy + offs_d[None, :], mask=mask, other=0.0)
        b = tl.load(wd_ptr + cols[:, None] * stride_wd + offs_d[None, :], mask=mask, other=0.0)
        acc += a.to(tl.float32) * b.to(tl.float32)
    u = tl.load(up_ptr + offs_e, mask=mask_e, other=0.0)
    h = tl.where(live, g * u, 0.0)
    sign = tl.where(h > 0, 1.0, tl.where(h < 0, -1.0, 0.0))
    dh = tl.sum(acc, axis=1) + (tl.load(l1_ptr).to(tl.float32) / M) * sign
    stored = offs_e < nnz
    tl.store(d_gate_ptr + offs_e, tl.where(live, dh * u, 0.0), mask=stored)
    tl.store(d_up_ptr + offs_e, tl.where(live, dh * g, 0.0), mask=stored)
    tl.store(h_ptr + offs_e, h, mask=stored)


_ENTRY_GRADS = fast(_entry_grads_kernel)


def entry_grads(
    rows: torch.Tensor, cols: torch.Tensor, dy: torch.Tensor, w_down: torch.Tensor, gate: torch.Tensor,
    up: torch.Tensor, grad_l1: torch.Tensor, M: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """The backward's per-entry gradients in one kernel (fp32 [nnz] each): with h = gate * up and
    dh = dy[row] . w_down[col] + grad_l1 / M * sign(h), returns (d_gate = dh * up, d_up = dh * gate, h).
    grad_l1: fp32 0-dim device tensor, the upstream gradient of l1 = sum |h| / M (M rows), read and
    divided on the device: no host sync, no separate launch for the scale."""
    nnz, D = rows.numel(), dy.shape[1]
    d_gate, d_up, h = torch.empty(3, nnz, device=dy.device, dtype=torch.float32).unbind()  # one allocation
    if nnz:
        grid = lambda meta: (cdiv(nnz, meta["BLOCK_E"]),)
        _ENTRY_GRADS[grid](
            rows, cols, dy, w_down, d_gate, nnz, dy.stride(0), w_down.stride(0), gate, up,
            grad_l1.reshape(1), M, d_up, h, D=D,
        )  # fmt: skip
    return d_gate, d_up, h


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
    # [BLOCK_E, BLOCK_D] accumulators: plain FMAs here, the reduction over entries happens once at the end.
    acc0 += c0[:, None] * t0
    if MODE == 2 or MODE == 3:
        c1 = tl.load(c1_ptr + offs_e, mask=mask_e, other=0.0).to(tl.float32)
        acc1 += c1[:, None] * t0
    if MODE == 3:
        c2 = tl.load(c2_ptr + offs_e, mask=mask_e, other=0.0).to(tl.float32)
        t2 = tl.load(s1_ptr + g[:, None] * stride_s1 + offs_d[None, :], mask=mask, other=0.0)
        acc2 += c2[:, None] * t2.to(tl.float32)
    return acc0, acc1, acc2


@triton.jit
def _store_sum(acc, out_ptr, part_ptr, out_offs, part_offs, direct, partial):
    """A work item's sum goes straight to the output row, or to a partial row when its segment was split."""
    tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=direct)
    tl.store(part_ptr + part_offs, acc, mask=partial)


@_tuned(_configs(_SHAPES), key=["D", "MODE", "LEN_BUCKET"])
@triton.jit(do_not_specialize=["LEN_BUCKET"])
def _segment_axpy_kernel(
    seg_ptr, item_seg_ptr, item_ptr_ptr, part_ptr_ptr, gidx_ptr, c0_ptr, c1_ptr, c2_ptr, s0_ptr, s1_ptr,
    o0_ptr, o1_ptr, o2_ptr, p0_ptr, p1_ptr, p2_ptr, n_seg, stride_s0, stride_s1, stride_o,
    LEN_BUCKET, D: tl.constexpr, CHUNK: tl.constexpr, MODE: tl.constexpr, WHILE_LOOP: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    item = tl.program_id(0)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    # Work item = up to CHUNK entries of one segment, so a hot unit's long column (thousands of
    # rows) is spread over many programs instead of one that finishes long after the rest.
    seg = tl.load(item_seg_ptr + item)
    valid = seg < n_seg  # the grid is an upper bound on the number of items
    seg = tl.minimum(seg, n_seg - 1)
    first_item = tl.load(item_ptr_ptr + seg)
    n_items = tl.load(item_ptr_ptr + seg + 1) - first_item
    chunk = item - first_item
    start = tl.load(seg_ptr + seg) + chunk * CHUNK
    end = tl.minimum(tl.load(seg_ptr + seg + 1), start + CHUNK)
    end = tl.where(valid, end, start)
    part_row = tl.load(part_ptr_ptr + seg) + chunk
    mask_d = offs_d < D
    acc0 = tl.zeros([BLOCK_E, BLOCK_D], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_E, BLOCK_D], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_E, BLOCK_D], dtype=tl.float32)
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
    part_offs = (part_row + tl.zeros([BLOCK_D], dtype=tl.int64)) * stride_o + offs_d
    # Every mask a bool block: newer interpreters reject integer masks and a scalar bool combined with
    # a block, so the scalars are broadcast before they are compared.
    zeros_d = tl.zeros([BLOCK_D], dtype=tl.int32)
    ok = ((zeros_d + valid) != 0) & mask_d
    direct = ok & ((zeros_d + n_items) == 1)
    partial = ok & ((zeros_d + n_items) > 1)
    _store_sum(tl.sum(acc0, axis=0), o0_ptr, p0_ptr, out_offs, part_offs, direct, partial)
    if MODE == 2 or MODE == 3:
        _store_sum(tl.sum(acc1, axis=0), o1_ptr, p1_ptr, out_offs, part_offs, direct, partial)
    if MODE == 3:
        _store_sum(tl.sum(acc2, axis=0), o2_ptr, p2_ptr, out_offs, part_offs, direct, partial)


@triton.jit(do_not_specialize=["max_split"])
def _sum_partials_kernel(
    split_ptr, max_split, item_ptr_ptr, part_ptr_ptr, p_ptr, o0_ptr, o1_ptr, o2_ptr, stride_o, stride_p,
    D: tl.constexpr, WHILE_LOOP: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """out_k[s] = sum of the partial rows of segment s, in chunk order (deterministic), for the split
    segments only: program i takes the i-th (split_ptr[i]; their number at split_ptr[max_split], so
    programs past it do nothing); k = program_id(2) picks the output (one launch for all outputs)."""
    i = tl.program_id(0)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    k = tl.program_id(2)
    mask_d = offs_d < D
    live = i < tl.load(split_ptr + max_split)
    seg = tl.where(live, tl.load(split_ptr + i), 0)
    n_items = tl.load(item_ptr_ptr + seg + 1) - tl.load(item_ptr_ptr + seg)
    n_items = tl.where(live, n_items, 0)
    first = tl.load(part_ptr_ptr + seg)
    n_parts = tl.where(n_items > 1, n_items, 0)
    p_ptr += k.to(tl.int64) * stride_p
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    if WHILE_LOOP:
        j = 0
        while j < n_parts:
            acc += tl.load(p_ptr + (first + j).to(tl.int64) * stride_o + offs_d, mask=mask_d, other=0.0)
            j += 1
    else:
        for j in range(0, n_parts):
            acc += tl.load(p_ptr + (first + j).to(tl.int64) * stride_o + offs_d, mask=mask_d, other=0.0)
    mask = mask_d & ((tl.zeros([BLOCK_D], dtype=tl.int32) + n_items) > 1)  # broadcast: see above
    out_offs = seg.to(tl.int64) * stride_o + offs_d
    if k == 0:
        tl.store(o0_ptr + out_offs, acc.to(o0_ptr.dtype.element_ty), mask=mask)
    elif k == 1:
        tl.store(o1_ptr + out_offs, acc.to(o1_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(o2_ptr + out_offs, acc.to(o2_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["max_split"])
def _work_list_kernel(
    seg_ptr, item_ptr_ptr, part_ptr_ptr, item_seg_ptr, split_ptr, n_seg, max_split, CHUNK: tl.constexpr,
    BLOCK: tl.constexpr, WHILE_LOOP: tl.constexpr,
):  # fmt: skip
    """One program: the split pass's work list from the segment pointers. Per segment s, n_items =
    max(1, ceil(len / CHUNK)) (an empty segment still writes its zeros); item_ptr / part_ptr = exclusive
    prefix sums of n_items and of the split segments' items (their partial rows); item_seg[i] = the
    segment of item i (entries past the last item keep the caller's fill, n_seg: invalid); split[j] =
    the j-th split segment (n_items > 1), their number in split[max_split]."""
    offs = tl.arange(0, BLOCK)
    ok = offs < n_seg
    start = tl.load(seg_ptr + offs, mask=ok, other=0)
    end = tl.load(seg_ptr + offs + 1, mask=ok, other=0)
    n_items = tl.where(ok, tl.maximum((end - start + CHUNK - 1) // CHUNK, 1), 0)
    incl = tl.cumsum(n_items, axis=0)
    first = offs == 0
    tl.store(item_ptr_ptr + offs + 1, incl, mask=ok)
    tl.store(item_ptr_ptr + offs, tl.zeros([BLOCK], dtype=tl.int32), mask=first)
    parts = tl.where(n_items > 1, n_items, 0)
    tl.store(part_ptr_ptr + offs + 1, tl.cumsum(parts, axis=0), mask=ok)
    is_split = (n_items > 1).to(tl.int32)
    split_rank = tl.cumsum(is_split, axis=0) - is_split
    tl.store(split_ptr + split_rank, offs, mask=is_split != 0)
    tl.store(
        split_ptr + max_split + offs, tl.zeros([BLOCK], dtype=tl.int32) + tl.sum(is_split, axis=0), mask=first
    )
    tl.store(part_ptr_ptr + offs, tl.zeros([BLOCK], dtype=tl.int32), mask=first)
    excl = incl - n_items
    most = tl.max(n_items, axis=0)
    if WHILE_LOOP:
        j = 0
        while j < most:
            tl.store(item_seg_ptr + excl + j, offs, mask=ok & (j < n_items))
            j += 1
    else:
        for j in range(0, most):
            tl.store(item_seg_ptr + excl + j, offs, mask=ok & (j < n_items))


# Segments up to which the work list is one single-program kernel (vectors of next_pow2(n_seg)
# elements); past it, torch ops build it (the CSC passes have n_seg = d_ff).
WORK_LIST_MAX_SEGMENTS = 32768


_WORK_LIST = fast(_work_list_kernel)


def _work_list(seg_ptr: torch.Tensor, n_seg: int, chunk: int, max_items: int, max_split: int):
    """(item_ptr [n_seg + 1], part_ptr [n_seg + 1], item_seg [max_items], split [max_split + 1]) int32;
    see _work_list_kernel (split[j] for j past the count is unspecified)."""
    device = seg_ptr.device
    split = torch.empty(max_split + 1, device=device, dtype=torch.int32)
    if n_seg <= WORK_LIST_MAX_SEGMENTS:
        item_ptr = torch.empty(n_seg + 1, device=device, dtype=torch.int32)
        part_ptr = torch.empty(n_seg + 1, device=device, dtype=torch.int32)
        item_seg = torch.full((max_items,), n_seg, device=device, dtype=torch.int32)
        block = max(16, triton.next_power_of_2(n_seg))
        warps = 4 if interpreting() else min(16, max(4, block // 1024))
        _WORK_LIST[(1,)](
            seg_ptr, item_ptr, part_ptr, item_seg, split, n_seg, max_split, CHUNK=chunk, BLOCK=block,
            WHILE_LOOP=interpreting(), num_warps=warps,
        )  # fmt: skip
        return item_ptr, part_ptr, item_seg, split
    seg_len = seg_ptr[1:] - seg_ptr[:-1]
    n_items = ((seg_len + (chunk - 1)) // chunk).clamp_min(1)  # an empty segment still writes zeros
    item_ptr = _exclusive_cumsum(n_items)
    is_split = n_items > 1
    part_ptr = _exclusive_cumsum(torch.where(is_split, n_items, 0))
    item_seg = torch.searchsorted(
        item_ptr[1:], torch.arange(max_items, device=device, dtype=torch.int32), right=True
    )
    # split segments in order: rank -> segment (others aimed at slot max_split, then overwritten by the count)
    rank = torch.where(is_split, torch.cumsum(is_split, 0) - 1, max_split)
    split.scatter_(0, rank, torch.arange(n_seg, device=device, dtype=torch.int32))
    split[max_split:] = is_split.sum(dtype=torch.int32)
    return item_ptr, part_ptr, item_seg.to(torch.int32), split


MAX_LEN_BUCKET = 1024
LEN_BUCKETS = tuple(2**i for i in range(MAX_LEN_BUCKET.bit_length()))  # every value _length_bucket takes


def _length_bucket(nnz: int, n_seg: int) -> int:
    """Mean segment length, rounded to a power of two: keys the autotuning so that short columns (hot
    units on tensor cores leave the sparse kernels ~25% of the entries) and long ones (~100-400
    entries) get their own tile shapes."""
    return min(triton.next_power_of_2(max(nnz // max(n_seg, 1), 1)), MAX_LEN_BUCKET)


def tune_length_buckets(
    n_seg: int,
    D: int,
    source_rows: int,
    mode: int,
    device,
    dtype=torch.bfloat16,
    chunk: int = 512,
    buckets: tuple[int, ...] = LEN_BUCKETS,
) -> None:
    """Autotune segment_axpy for every mean-length bucket (LEN_BUCKETS) at this shape, on columns of
    exactly that length. A run meets the buckets as its layers' activity moves (16 to 1024 while a
    layer that just switched sheds units, 1 to 8 in very sparse layers); each first met mid-run stopped
    the step for ~4 s of compiling and timing (H200, paper_1.5b: seven buckets, ~25 s of stalls after
    the last layers switched). Tuned here, before training, and kept on disk by kernels._common.autotune,
    a later run pays nothing. dtype: the sources' and outputs' (the autotuning key holds the dtypes)."""
    gen = torch.Generator(device=device).manual_seed(0)
    n_sources, n_outs = {ONE: (1, 1), SPLIT2: (1, 2), SPLIT3: (2, 3)}[mode]
    sources = tuple(
        torch.randn(source_rows, D, generator=gen, device=device, dtype=torch.float32).to(dtype)
        for _ in range(n_sources)
    )
    outs = tuple(torch.empty(n_seg, D, device=device, dtype=dtype) for _ in range(n_outs))
    for bucket in buckets:
        nnz = bucket * n_seg
        seg_ptr = torch.arange(0, nnz + 1, bucket, device=device, dtype=torch.int32)
        gidx = torch.randint(0, source_rows, (nnz,), generator=gen, device=device, dtype=torch.int32)
        coefs = tuple(torch.randn(nnz, generator=gen, device=device) for _ in range(n_outs))
        segment_axpy(seg_ptr, gidx, coefs, sources, outs, mode, chunk)


def _exclusive_cumsum(counts: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(counts.numel() + 1, device=counts.device, dtype=torch.int32)
    torch.cumsum(counts, dim=0, dtype=torch.int32, out=out[1:])
    return out


_SEGMENT_AXPY = fast(_segment_axpy_kernel)


_SUM_PARTIALS = fast(_sum_partials_kernel)


def segment_axpy(
    seg_ptr: torch.Tensor,
    gidx: torch.Tensor,
    coefs: tuple[torch.Tensor, ...],
    sources: tuple[torch.Tensor, ...],
    outs: tuple[torch.Tensor, ...],
    mode: int,
    chunk: int = 512,
) -> None:
    """Fill `outs` ([n_seg, D] each, fully written) with segment sums of gathered source rows.

    seg_ptr int32 [n_seg + 1] (segment s = entries seg_ptr[s]:seg_ptr[s+1]); gidx [nnz] the source
    row of each entry; coefs fp32 [nnz] each. The number of coefs/sources/outs follows `mode`.
    Segments longer than `chunk` entries are split over several programs whose fp32 partial sums a
    second kernel adds up in order: no atomics, bit-identical results run to run, no host sync
    (the grid and the partial buffer are sized by bounds known from nnz).
    """
    n_seg, D = outs[0].shape
    nnz, device = gidx.numel(), gidx.device
    if n_seg == 0 or nnz == 0:  # nothing to gather (no entry at all)
        for out in outs:
            out.zero_()
        return
    c = coefs + (coefs[0],) * (3 - len(coefs))
    s = sources + (sources[0],) * (2 - len(sources))
    o = outs + (outs[0],) * (3 - len(outs))
    assert all(t.stride(1) == 1 for t in s + o) and all(t.stride(0) == D for t in o)

    # sum max(1, ceil(len / chunk)) <= n_seg + nnz / chunk; split segments have len > chunk, so
    # their items, sum ceil(len / chunk) <= 2 * nnz / chunk, bound the partial rows.
    max_items = n_seg + nnz // chunk + 1
    max_parts = 2 * (nnz // chunk)
    max_split = nnz // chunk  # a split segment has more than chunk entries
    item_ptr, part_ptr, item_seg, split = _work_list(seg_ptr, n_seg, chunk, max_items, max_split)
    parts = torch.empty((len(outs), max(max_parts, 1), D), device=device, dtype=torch.float32)
    p = tuple(parts[min(i, len(outs) - 1)] for i in range(3))

    grid = lambda meta: (max_items, cdiv(D, meta["BLOCK_D"]))
    _SEGMENT_AXPY[grid](
        seg_ptr, item_seg, item_ptr, part_ptr, gidx, c[0], c[1], c[2], s[0], s[1],
        o[0], o[1], o[2], p[0], p[1], p[2], n_seg, s[0].stride(0), s[1].stride(0), o[0].stride(0),
        _length_bucket(nnz, n_seg), D=D, CHUNK=chunk, MODE=mode, WHILE_LOOP=interpreting(),
    )  # fmt: skip
    if max_parts:
        # One program per possible split segment (<= nnz / chunk), not per segment: at d_ff 5632 that
        # was ~135k programs, nearly all with nothing to add (83 us at 16k tokens on an H200).
        _SUM_PARTIALS[(max_split, cdiv(D, 256), len(outs))](
            split, max_split, item_ptr, part_ptr, parts, o[0], o[1], o[2], o[0].stride(0), parts.stride(0),
            D=D, WHILE_LOOP=interpreting(), BLOCK_D=256,
        )  # fmt: skip
