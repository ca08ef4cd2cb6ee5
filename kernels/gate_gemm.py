"""The gate GEMM kernels: relu(x @ w_gate^T) on tensor cores with a TwELL, dense or dense_bits epilogue.

Each program of `_twell_gate_kernel` computes a [BLOCK_M, tile_n] tile of the gate pre-activation and
applies its epilogue: "twell" compacts every row of the tile in registers (kernels/gate_compact.py,
_compact_chunk: a prefix sum over the positive mask gives each positive value its slot, so the
(column, value) entries land in order without atomics, without a dense h in memory and without a host
sync); "dense" stores relu densely, "dense_bits" that plus the positive bitmask (the two-kernel path's
first pass), "counts" only the per-(row, tile) counts (the benchmark's mainloop-only cost).

Mainloop: operands come through TMA tensor descriptors on Hopper and later (no per-element pointer
math or masks in the loop: out-of-range rows of the last block are zero-filled by the hardware), or
through plain pointer loads elsewhere. The dense_bits GEMM also runs as a persistent kernel
(`_relu_bits_persistent_kernel`, the GPU default). scripts/bench_gate.py times each variant against
cuBLAS. Which path a call takes is chosen in kernels/gate.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (
    autotune,
    cdiv,
    device_major,
    dot_in_fp32,
    dot_precision,
    interpreting,
    next_pow2,
    sm_count,
)
from ._launch import fast
from .bitmask import _bit_or
from .gate_compact import _compact_chunk, _off32

# What the epilogue writes; only TWELL is API, DENSE and COUNTS exist to time the mainloop in isolation.
# dense_bits: the dense relu store plus a positive bitmask, one int32 word per (row, 32 columns), written
# to the `counts` argument ([M, F // 32]); the two-kernel path's first pass (see _compact_bits_kernel).
EPI_TWELL, EPI_DENSE, EPI_COUNTS, EPI_DENSE_BITS = 0, 1, 2, 4
EPILOGUES = {"twell": EPI_TWELL, "dense": EPI_DENSE, "counts": EPI_COUNTS, "dense_bits": EPI_DENSE_BITS}

# The benchmark switches, set by kernels.gate.set_gate_variant; None: the default for the device (see
# _tma_loads / launch_gate). sub_n: columns per mainloop + compaction step inside a format tile; path: "fused" (compaction in the GEMM epilogue) or "two_kernel";
# compact (two_kernel only): "bits" (GEMM writes a positive bitmask, the compaction visits set bits only)
# or "scan" (round-4 kernel: full-width scan of h).
_variant = {
    "loads": None,
    "sub_n": None,
    "path": None,
    "compact": None,
    "bits_gemm": None,
}
DEFAULT_SUB_N = 128  # 128x256 fp32 accumulators + the scan spilled (bench: 20.6 ms vs 4.4 ms dense)


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
    """fp32 [BLOCK_M, BLOCK_N] tile of x @ w^T via pointer loads (x [M, D], w [F, D], row-major;
    D % BLOCK_K == 0). Out-of-range rows/cols are clamped, not masked, so loads stay unpredicated and
    vectorised; their results are garbage the caller must mask. D is constexpr because the
    interpreter cannot loop to a runtime bound inside a nested jit function."""
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    safe_rows = tl.minimum(rows, M - 1)
    safe_cols = tl.minimum(cols, F - 1)
    x_ptrs = x_ptr + safe_rows[:, None].to(tl.int64) * D + ks[None, :]
    w_ptrs = w_ptr + safe_cols[None, :].to(tl.int64) * D + ks[:, None]
    for _ in range(0, D, BLOCK_K):
        a = tl.load(x_ptrs)
        b = tl.load(w_ptrs)
        if DOT_FP32:  # the interpreter's 16-bit tl.dot is wrong; upcast there only
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    return acc


@triton.jit
def _gate_tile_tma(
    x_desc, w_desc, off_m, off_n, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Same tile through TMA descriptors (rows past M / cols past F read as zeros)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, D, BLOCK_K):
        a = x_desc.load([off_m, k])
        b = w_desc.load([off_n, k])
        if DOT_FP32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b.T, acc, input_precision=PRECISION)
    return acc


@triton.jit
def _twell_epilogue(
    pre,
    rows,
    cols,
    tile,
    M,
    F,
    T,
    counts_ptr,
    dense_ptr,
    EPILOGUE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """The epilogues other than twell (EPILOGUE 1/2/4: dense, counts, dense_bits)."""
    row_ok = rows < M
    if EPILOGUE == 1 or EPILOGUE == 4:  # dense relu store: the cost of a plain GEMM's epilogue
        off = rows[:, None].to(tl.int64) * F + cols[None, :]
        tl.store(
            dense_ptr + off,
            tl.maximum(pre, 0.0).to(dense_ptr.dtype.element_ty),
            mask=row_ok[:, None] & (cols[None, :] < F),
        )
        if EPILOGUE == 4:  # + bit c%32 of word [row, c // 32] set iff pre[row, c] > 0 (counts_ptr: [M, F/32])
            pos = ((pre > 0) & (cols[None, :] < F)).to(tl.uint32)
            lane = tl.arange(0, 32).to(tl.uint32)
            b = tl.reshape(pos, (pre.shape[0], BLOCK_N // 32, 32)) << lane[None, None, :]
            words = tl.reduce(b, 2, _bit_or)
            W = F // 32
            wi = tile * (BLOCK_N // 32) + tl.arange(0, BLOCK_N // 32)
            tl.store(
                counts_ptr + rows[:, None].to(tl.int64) * W + wi[None, :],
                words.to(tl.int32, bitcast=True),
                mask=row_ok[:, None] & (wi < W)[None, :],
            )
    else:  # counts: the mainloop plus a per-row count only
        count = tl.sum(((pre > 0) & (cols[None, :] < F)).to(tl.int32), axis=1)
        tl.store(counts_ptr + rows.to(tl.int64) * T + tile, count, mask=row_ok)


@triton.jit
def _grouped_tile(tile_id, n_m, n_n, GROUP_M: tl.constexpr):
    """(row block, column tile) of output tile `tile_id` in grouped order: GROUP_M row blocks sweep all
    n_n column tiles together, so the x rows of the group and the weight tiles both stay in L2."""
    per_group = GROUP_M * n_n
    first_m = (tile_id // per_group) * GROUP_M
    size = tl.minimum(n_m - first_m, GROUP_M)
    return first_m + (tile_id % per_group) % size, (tile_id % per_group) // size


@triton.jit
def _twell_gate_kernel(
    x_src,
    w_src,
    counts_ptr,
    cols_ptr,
    vals_ptr,
    dense_ptr,
    M,
    F,
    T,
    M_BUCKET,
    zero_ptr,
    n_zero,
    D: tl.constexpr,
    SLOTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SUB_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    TMA: tl.constexpr,
    EPILOGUE: tl.constexpr,
    OFF32: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
    ZERO_BLOCK: tl.constexpr,
):
    # One program per output tile. x_src / w_src are tensor descriptors when TMA, else pointers.
    # M_BUCKET only keys autotuning. BLOCK_N is the format tile; with the twell epilogue the program
    # walks it in BLOCK_N // SUB_N mainloop + compaction steps.
    if ZERO_BLOCK > 0:  # int32 zero_ptr[:n_zero] (a consumer's per-row counters): no separate fill node
        if tl.program_id(0) == 0:
            zo = tl.arange(0, ZERO_BLOCK)
            tl.store(zero_ptr + zo, tl.zeros([ZERO_BLOCK], dtype=tl.int32), mask=zo < n_zero)
    pid_m, tile = _grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), T, GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if EPILOGUE == 0:
        # Compaction in SUB_N-column steps: a [BLOCK_M, SUB_N] accumulator leaves registers for the
        # scan and the scattered stores (a whole 128x256 fp32 tile plus the scan spilled); the x tile
        # is re-read from L2 per step. `done` carries each row's positives of the earlier steps.
        done = tl.zeros((BLOCK_M,), dtype=tl.int32)
        for j in tl.static_range(BLOCK_N // SUB_N):
            off_n = tile * BLOCK_N + j * SUB_N
            cols = off_n + tl.arange(0, SUB_N)
            if TMA:
                pre = _gate_tile_tma(
                    x_src, w_src, pid_m * BLOCK_M, off_n, D, BLOCK_M, SUB_N, BLOCK_K, DOT_FP32, PRECISION
                )
            else:
                pre = gate_tile_preact(
                    x_src, w_src, rows, cols, M, F, D, BLOCK_M, SUB_N, BLOCK_K, DOT_FP32, PRECISION
                )
            done += _compact_chunk(pre, rows, cols, tile, done, M, F, T, cols_ptr, vals_ptr, SLOTS, OFF32)
        tl.store(counts_ptr + rows.to(tl.int64) * T + tile, done, mask=rows < M)
    else:
        cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        if TMA:
            pre = _gate_tile_tma(
                x_src, w_src, pid_m * BLOCK_M, tile * BLOCK_N, D, BLOCK_M, BLOCK_N, BLOCK_K, DOT_FP32,
                PRECISION,
            )  # fmt: skip
        else:
            pre = gate_tile_preact(
                x_src, w_src, rows, cols, M, F, D, BLOCK_M, BLOCK_N, BLOCK_K, DOT_FP32, PRECISION
            )
        _twell_epilogue(pre, rows, cols, tile, M, F, T, counts_ptr, dense_ptr, EPILOGUE, BLOCK_N)


def _set_desc_blocks(nargs):
    """Autotune pre-hook: TMA descriptors carry the block shape, which depends on the config."""
    if nargs["TMA"]:
        nargs["x_src"].block_shape = [nargs["BLOCK_M"], nargs["BLOCK_K"]]
        width = nargs["SUB_N"] if nargs["EPILOGUE"] == EPI_TWELL else nargs["BLOCK_N"]
        nargs["w_src"].block_shape = [width, nargs["BLOCK_K"]]


def _configs(regime: str) -> list[triton.Config]:
    # Few configs: each GPU run is short. Hopper wants 128-row tiles and 8 warps for the big GEMM;
    # decode (M <= 64) is a GEMV that lives off bytes in flight: deep pipelines of wide K steps.
    table = {
        "large": [(128, 64, 8, 3), (128, 64, 8, 4), (64, 64, 4, 4)],
        "mid": [(128, 64, 8, 3), (64, 64, 4, 4)],
        "small": [(64, 64, 4, 4), (64, 128, 4, 3)],
        "decode": [(None, 128, 4, 4), (None, 128, 8, 4), (None, 128, 4, 6)],
    }[regime]
    return [
        triton.Config(
            {"BLOCK_K": bk} if bm is None else {"BLOCK_M": bm, "BLOCK_K": bk},
            num_warps=w,
            num_stages=s,
            pre_hook=_set_desc_blocks,
        )
        for bm, bk, w, s in table
    ]


_TUNED: dict[tuple, object] = {}


def _tuned_kernel(regime: str):
    if regime not in _TUNED:
        _TUNED[regime] = autotune(
            configs=_configs(regime),
            key=["M_BUCKET", "F", "D", "BLOCK_N", "SUB_N", "SLOTS", "TMA", "EPILOGUE"],
        )(_twell_gate_kernel)
    return _TUNED[regime]


def _regime(M: int) -> str:
    if M <= 64:
        return "decode"
    return "large" if M >= 2048 else ("mid" if M >= 256 else "small")


def _tma_loads(x: torch.Tensor) -> bool:
    """TMA loads needs Hopper+; the interpreter runs the TMA path too (it emulates descriptors), so CPU
    tests cover the production mainloop."""
    loads = _variant["loads"]
    if loads is None:
        return interpreting() or device_major(x.device) >= 9
    return loads == "tma"


def _launch_gemm(x, w_gate, counts, cols, vals, tile_n, slots, epilogue, dense, zero=None) -> None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    M, D = x.shape
    F = w_gate.shape[0]
    T = cdiv(F, tile_n)
    sub_n = min(tile_n, _variant["sub_n"] or DEFAULT_SUB_N)
    if interpreting():
        sub_n = min(tile_n, _variant["sub_n"] or 32)  # CPU tests walk >= 2 steps per tile
    # TMA needs 16-byte aligned bases (a contiguous view may start mid-allocation): else plain loads.
    tma = _tma_loads(x) and x.data_ptr() % 16 == 0 and w_gate.data_ptr() % 16 == 0
    if interpreting():
        block_m, block_k = 32, 64
    else:
        block_m, block_k = 128, 64  # placeholders: the autotuner's pre-hook sets the real ones
    regime = _regime(M)
    fixed = {}
    if regime == "decode" or interpreting():
        fixed["BLOCK_M"] = block_m = max(16, next_pow2(M)) if not interpreting() else block_m
    if tma:
        x_src = TensorDescriptor.from_tensor(x, [block_m, block_k])
        w_width = sub_n if epilogue == "twell" else tile_n
        w_src = TensorDescriptor.from_tensor(w_gate, [w_width, block_k])
    else:
        x_src, w_src = x, w_gate
    args = (x_src, w_src, counts, cols, vals, dense if dense is not None else vals, M, F, T)
    n_zero = 0 if zero is None else zero.numel()
    zero_args = (zero if n_zero else counts, n_zero)
    common = dict(
        D=D,
        SLOTS=slots,
        BLOCK_N=tile_n,
        SUB_N=sub_n,
        GROUP_M=8,
        TMA=tma,
        EPILOGUE=EPILOGUES[epilogue],
        OFF32=_off32(M, F, tile_n, slots),
        DOT_FP32=dot_in_fp32(x.dtype),
        PRECISION=dot_precision(x.dtype),
        ZERO_BLOCK=next_pow2(n_zero) if n_zero else 0,
    )
    m_bucket = min(next_pow2(M), 1 << 17)
    if interpreting():
        grid = (cdiv(M, block_m) * T,)
        _twell_gate_kernel[grid](*args, m_bucket, *zero_args, BLOCK_K=block_k, **fixed, **common)
        return

    _tuned_kernel(regime)[lambda meta: (cdiv(M, meta["BLOCK_M"]) * T,)](
        *args, m_bucket, *zero_args, **fixed, **common
    )


# ---- The dense_bits GEMM as a persistent kernel -------------------------------------------------
# One program per SM walks output tiles in grouped order; the tile loop is flattened into the K loop
# (tl.range(flatten=True)) so the software pipeliner prefetches the next tile's operands while this
# tile's epilogue runs, and h leaves through TMA stores (asynchronous, from shared memory) in two
# column halves. The epilogue is the dense_bits one: relu(x w^T) to h and one int32 word of positive
# bits per (row, 32 columns). Measured against the tile-per-program kernel in scripts/bench_gate.py.


@triton.jit
def _relu_bits_store(acc, h_desc, bits_ptr, pid_m, pid_n, M, W, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     SPLIT_STORE: tl.constexpr):  # fmt: skip
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    pos = (acc > 0).to(tl.uint32)
    lane = tl.arange(0, 32).to(tl.uint32)
    words = tl.reduce(tl.reshape(pos, (BLOCK_M, BLOCK_N // 32, 32)) << lane[None, None, :], 2, _bit_or)
    rows = off_m + tl.arange(0, BLOCK_M)
    wi = pid_n * (BLOCK_N // 32) + tl.arange(0, BLOCK_N // 32)
    tl.store(
        bits_ptr + rows[:, None].to(tl.int64) * W + wi[None, :],
        words.to(tl.int32, bitcast=True),
        mask=(rows < M)[:, None] & (wi < W)[None, :],
    )
    h = tl.maximum(acc, 0.0).to(h_desc.dtype)
    if SPLIT_STORE:  # two [BLOCK_M, BLOCK_N / 2] stores: half the staging buffer in shared memory
        h0, h1 = tl.split(tl.permute(tl.reshape(h, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
        h_desc.store([off_m, off_n], h0)
        h_desc.store([off_m, off_n + BLOCK_N // 2], h1)
    else:
        h_desc.store([off_m, off_n], h)


@triton.jit
def _relu_bits_persistent_kernel(
    x_desc, w_desc, h_desc, bits_ptr, M, F, M_BUCKET, D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, NUM_PROGS: tl.constexpr,
    SPLIT_STORE: tl.constexpr, FLATTEN: tl.constexpr, WHILE_LOOP: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """h = relu(x @ w^T) [M, F] and its positive bitmask [M, F // 32]; x [M, D] and w [F, D] through
    TMA descriptors (out-of-range rows, columns and K read as zeros; out-of-range stores are dropped).
    M_BUCKET only keys autotuning. WHILE_LOOP: the interpreter's form of the tile loop."""
    n_m = tl.cdiv(M, BLOCK_M)
    n_n = tl.cdiv(F, BLOCK_N)
    n_tiles = n_m * n_n
    W = F // 32
    if WHILE_LOOP:
        tile_id = tl.program_id(0)
        while tile_id < n_tiles:
            pid_m, pid_n = _grouped_tile(tile_id, n_m, n_n, GROUP_M)
            acc = _gate_tile_tma(x_desc, w_desc, pid_m * BLOCK_M, pid_n * BLOCK_N, D, BLOCK_M, BLOCK_N, BLOCK_K,
                                 DOT_FP32, PRECISION)  # fmt: skip
            _relu_bits_store(acc, h_desc, bits_ptr, pid_m, pid_n, M, W, BLOCK_M, BLOCK_N, SPLIT_STORE)
            tile_id += NUM_PROGS
    else:
        # The epilogue's tile id advances on its own counter (as in Triton's persistent matmul): with
        # a flattened loop the pipeliner may run the next tile's loads before this epilogue.
        tile_c = tl.program_id(0) - NUM_PROGS
        for tile_id in tl.range(tl.program_id(0), n_tiles, NUM_PROGS, flatten=FLATTEN):
            pid_m, pid_n = _grouped_tile(tile_id, n_m, n_n, GROUP_M)
            acc = _gate_tile_tma(x_desc, w_desc, pid_m * BLOCK_M, pid_n * BLOCK_N, D, BLOCK_M, BLOCK_N, BLOCK_K,
                                 DOT_FP32, PRECISION)  # fmt: skip
            tile_c += NUM_PROGS
            pid_m, pid_n = _grouped_tile(tile_c, n_m, n_n, GROUP_M)
            _relu_bits_store(acc, h_desc, bits_ptr, pid_m, pid_n, M, W, BLOCK_M, BLOCK_N, SPLIT_STORE)


def _persistent_set_blocks(nargs):
    """Autotune pre-hook: the descriptors carry the config's block shapes."""
    bm, bn, bk = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["BLOCK_K"]
    nargs["x_desc"].block_shape = [bm, bk]
    nargs["w_desc"].block_shape = [bn, bk]
    nargs["h_desc"].block_shape = [bm, bn // 2 if nargs["SPLIT_STORE"] else bn]


# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, split store, flatten): the best three of
# the bench_gate.py --bits-gemm sweep on an H200 (docs/results/bench_bits_gemm_round10.txt; 16384 x
# 2048 x 5632: 0.551 / 0.530 / 0.533 ms against 0.599 for the tile-per-program kernel and 0.490 for
# cuBLAS without any epilogue; 131072: 4.466 / 4.600 / 5.100 against 4.818 and 4.356). Four stages of
# 128x256x64 do not fit in shared memory next to the store buffer; warp specialization (tl.range's
# warp_specialize, removed) gained nothing.
PERSISTENT_CONFIGS = [
    (128, 256, 64, 8, 3, True, True),
    (128, 256, 64, 8, 3, True, False),
    (128, 128, 64, 8, 5, True, True),
]
_persistent_tuned: dict = {}


def _persistent_config(cfg) -> triton.Config:
    bm, bn, bk, warps, stages, split, flatten = cfg
    meta = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_STORE=split, FLATTEN=flatten)
    return triton.Config(meta, num_warps=warps, num_stages=stages, pre_hook=_persistent_set_blocks)


def launch_relu_bits_persistent(x, w, h, bits, config=None) -> None:
    """relu(x @ w^T) into h [M, F] and its bitmask into bits [M, F // 32] with the persistent kernel;
    `config`: one PERSISTENT_CONFIGS tuple (the benchmark's sweep) instead of autotuning."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    M, D = x.shape
    F = w.shape[0]
    if interpreting():
        bm, bn, bk = 32, 64, 64
        descs = (
            TensorDescriptor.from_tensor(t, blk)
            for t, blk in ((x, [bm, bk]), (w, [bn, bk]), (h, [bm, bn // 2]))
        )
        n_progs = 3  # fewer programs than tiles: every program walks several
        _relu_bits_persistent_kernel[(n_progs,)](
            *descs, bits, M, F, 0, D=D, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=4, NUM_PROGS=n_progs,
            SPLIT_STORE=True, FLATTEN=False, WHILE_LOOP=True, DOT_FP32=dot_in_fp32(x.dtype),
            PRECISION=dot_precision(x.dtype),
        )  # fmt: skip
        return
    n_sm = sm_count(x.device)
    descs = [TensorDescriptor.from_tensor(t, [64, 64]) for t in (x, w, h)]  # blocks set per config
    common = dict(
        D=D, GROUP_M=8, NUM_PROGS=n_sm, WHILE_LOOP=False, DOT_FP32=False, PRECISION=dot_precision(x.dtype)
    )

    def grid(meta):
        return (min(n_sm, cdiv(M, meta["BLOCK_M"]) * cdiv(F, meta["BLOCK_N"])),)

    if config is not None:
        cfg = _persistent_config(config)
        cfg.pre_hook({**cfg.kwargs, "x_desc": descs[0], "w_desc": descs[1], "h_desc": descs[2]})
        _relu_bits_persistent_kernel[grid({**cfg.kwargs})](
            *descs, bits, M, F, 0, **common, **cfg.kwargs, num_warps=cfg.num_warps, num_stages=cfg.num_stages
        )
        return
    if "k" not in _persistent_tuned:
        _persistent_tuned["k"] = fast(
            autotune(configs=[_persistent_config(c) for c in PERSISTENT_CONFIGS], key=["M_BUCKET", "F", "D"])(
                _relu_bits_persistent_kernel
            )
        )
    _persistent_tuned["k"][grid](*descs, bits, M, F, min(next_pow2(M), 1 << 17), **common)
