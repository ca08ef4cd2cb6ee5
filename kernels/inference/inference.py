"""TwELL inference FFN: y = sum_j relu(g_j) * (x . w_up[j]) * w_down[j], no autograd, no host sync.

Three schedules (`schedule=`; the default picks by batch size):
- "fused" (1-2 tokens by default, 1-4 from d_ff 8192; at most FUSED_MAX_TOKENS): the whole FFN in one kernel
  (kernels/inference/decode_fused.py): gate GEMV, gathers of the live units' rows and fp32 atomics into y, no
  format in memory and no second launch; y's last bit may vary run to run (the row schedule under
  torch.use_deterministic_algorithms(True)).
- "row" (decode sizes, 3-64 tokens): the gate kernel writes the TwELL format from its epilogue and one
  program per token row (split over several programs at decode sizes) walks its TwELL entries on CUDA
  cores, gathering w_up[j] and w_down[j] per active unit (the paper's reference schedule); overflow
  tiles (more positives than slots) are recomputed densely from x and w_gate inside the program. h is
  never in memory.
- "csr" (above 64 tokens): the relu GEMM writes h densely with a positive bitmask; the bitmask is
  compacted into a CSR of the positives (kernels/training/train_format.py, no host sync: a fixed capacity) and
  the training op's row kernel walks each row's contiguous entries (kernels/training/train_rowfwd.py). Rows
  whose entries run past the capacity read the rest from h. Faster at large batches: no tile walk.

Hot units (`hot_units=K`; by default only the row schedule from HOT_MIN_TOKENS tokens): the K units
that fire most often in this batch (counted exactly from the gate GEMM's positive bitmask, chosen by
one selection kernel on the GPU) are computed densely on tensor cores,
y_hot = (g_hot * (x @ w_up[hot]^T)) @ w_down[hot]; the compaction leaves those columns out of the
sparse entries, and the row kernels start from y_hot. Exact for any choice of hot set.
(The "block" union schedule lost everywhere on the H200 and was removed.)
Under torch.compile a call with the default schedule is one custom op (`twell::ffn_inference`), so a
compiled block is not cut at its FFN; eager calls launch the kernels directly.
docs/KERNELS.md has the arithmetic.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .._common import (
    autotune,
    check_ffn_args,
    check_hot_prefix,
    check_hot_units,
    check_kernel_device,
    interpreting,
    next_pow2,
)
from ..bitmask import count_fires
from ..gate import _twell_gate, relu_gate_bits, twell_gate_hot
from ..training.train_format import build_pattern, hot_split
from ..training.train_rowfwd import row_ffn_inference
from .decode_fused import FUSED_MAX_TOKENS, FUSED_TILES, fused_ffn_decode, fused_workspace
from .prefix import gated_up

# "row": the TwELL format (tile-wise ELL, the gate kernel's sparse epilogue) walked by one program per
# row; "csr": the gate's positive bitmask compacted into a CSR of the cold positives (as the training
# op builds it) walked by the training op's row kernel (contiguous entries: no tile walk). Default: row
# at decode sizes (M <= DECODE_MAX_TOKENS: fused gate epilogue, graph-friendly), csr above; "fused"
# (kernels/inference/decode_fused.py): the whole FFN in one kernel for M <= FUSED_MAX_TOKENS, the default up to
# default_fused_tokens(d_ff).
SCHEDULES = ("row", "csr", "fused")
DEFAULT_FUSED_TOKENS = 2  # H200, per layer in an 8-layer graph: NOTES round 16
# From this d_ff the fused kernel also wins at 4 tokens (H200, two nodes: 19.4 / 19.5 us a layer against
# the row schedule's 21.2 / 21.2 at d_ff 8192; at 5632 the row schedule wins: NOTES rounds 16-17).
WIDE_FUSED_D_FF = 8192
WIDE_FUSED_TOKENS = 4


def default_fused_tokens(d_ff: int) -> int:
    """Up to how many tokens the default call takes the fused kernel at this d_ff."""
    return WIDE_FUSED_TOKENS if d_ff >= WIDE_FUSED_D_FF else DEFAULT_FUSED_TOKENS


class InferenceStats(NamedTuple):
    overflow_rows: torch.Tensor  # int32 0-dim: rows that took the overflow path


@triton.jit
def _entry_chunk(
    x, e, total, incl, excl, ts, row, cols_ptr, vals_ptr, wu_ptr, wd_ptr, ds, d_ok,
    T: tl.constexpr, D: tl.constexpr, SLOTS: tl.constexpr,
):  # fmt: skip
    """sum over the row's flattened entries e (a [CH] vector of indices) of g * (x . w_up[j]) * w_down[j].

    The row's entries are numbered across its tiles (tile t holds [excl[t], incl[t])), so one chunk can
    span tiles: no serial walk over mostly-empty tiles, and CH independent row loads are in flight."""
    ok = e < total
    # tile of entry e = number of tiles that end at or before e; its first entry = excl of that tile
    ends_before = (incl[None, :] <= e[:, None]) & (ts[None, :] < T)
    tile_of = tl.sum(ends_before.to(tl.int32), axis=1)
    start = tl.sum(tl.where(ts[None, :] == tile_of[:, None], excl[None, :], 0), axis=1)
    entry = (row * T + tile_of) * SLOTS + (e - start)
    units = tl.load(cols_ptr + entry, mask=ok, other=0).to(tl.int64)
    gate = tl.load(vals_ptr + entry, mask=ok, other=0.0).to(tl.float32)
    w_off = units[:, None] * D + ds[None, :]
    live = ok[:, None] & d_ok[None, :]
    # Both weight rows are issued before any math so their L2 latencies overlap; weights are the
    # reused operand (other tokens hit the same hot units): keep them in L2.
    wu = tl.load(wu_ptr + w_off, mask=live, other=0.0, eviction_policy="evict_last")
    wd = tl.load(wd_ptr + w_off, mask=live, other=0.0, eviction_policy="evict_last")
    h = gate * tl.sum(wu.to(tl.float32) * x[None, :], axis=1)
    return tl.sum(h[:, None] * wd.to(tl.float32), axis=0)


@triton.jit
def _overflow_tile(x, row, tile, wg_ptr, wu_ptr, wd_ptr, vals_ptr, hot_ptr, ds, d_ok, F, D: tl.constexpr,
                   TILE_N: tl.constexpr, OCH: tl.constexpr, HOT: tl.constexpr):  # fmt: skip
    """A tile whose positives did not fit the slots: recompute it densely from w_gate (exact). With HOT,
    hot units (hot_pos >= 0) are skipped: the dense hot part already holds them."""
    acc = tl.zeros(ds.shape, dtype=tl.float32)
    for c0 in range(0, TILE_N, OCH):
        units = tile * TILE_N + c0 + tl.arange(0, OCH)
        unit_ok = units < F
        w_off = units[:, None].to(tl.int64) * D + ds[None, :]
        wg = tl.load(wg_ptr + w_off, mask=unit_ok[:, None] & d_ok[None, :], other=0.0)
        gate = tl.maximum(tl.sum(wg.to(tl.float32) * x[None, :], axis=1), 0.0)
        # Round like the TwELL values so both paths give the same numbers.
        gate = gate.to(vals_ptr.dtype.element_ty).to(tl.float32)
        if HOT:
            gate = tl.where(tl.load(hot_ptr + units, mask=unit_ok, other=0) < 0, gate, 0.0)
        live = (gate > 0)[:, None] & d_ok[None, :]
        wu = tl.load(wu_ptr + w_off, mask=live, other=0.0)
        wd = tl.load(wd_ptr + w_off, mask=live, other=0.0)
        h = gate * tl.sum(wu.to(tl.float32) * x[None, :], axis=1)
        acc += tl.sum(h[:, None] * wd.to(tl.float32), axis=0)
    return acc


@triton.jit
def _row_consumer_kernel(
    x_ptr,
    wg_ptr,
    wu_ptr,
    wd_ptr,
    y_ptr,
    counts_ptr,
    cols_ptr,
    vals_ptr,
    hot_ptr,
    init_ptr,
    parts_ptr,
    tickets_ptr,
    F,
    n_rows,
    M_BUCKET,
    T: tl.constexpr,
    T_PAD: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TILE_N: tl.constexpr,
    SLOTS: tl.constexpr,
    CHUNK: tl.constexpr,
    SPLIT: tl.constexpr,
    DYNAMIC_LOOPS: tl.constexpr,
    HOT: tl.constexpr,
):
    # Program (row, part): part takes the row's chunks part, part + SPLIT, ... and its overflow tiles
    # t = part mod SPLIT. SPLIT > 1 (decode: few rows, many SMs): see the end.
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    ds = tl.arange(0, BLOCK_D)
    d_ok = ds < D
    x = tl.load(x_ptr + row * D + ds, mask=d_ok, other=0.0, eviction_policy="evict_first").to(tl.float32)
    ts = tl.arange(0, T_PAD)
    counts = tl.load(counts_ptr + row * T + ts, mask=ts < T, other=0)
    overflow = counts > SLOTS
    listed = tl.where(overflow, 0, counts)  # overflow tiles are recomputed below, not read from slots
    incl = tl.cumsum(listed, axis=0)
    excl = incl - listed
    total = tl.sum(listed, axis=0)
    if HOT:  # start from the dense hot part's y row (SPLIT == 1 only)
        acc = tl.load(init_ptr + row * D + ds, mask=d_ok, other=0.0, eviction_policy="evict_first").to(
            tl.float32
        )
    else:
        acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    lanes = tl.arange(0, CHUNK)
    if DYNAMIC_LOOPS:
        for e0 in range(part * CHUNK, total, SPLIT * CHUNK):
            acc += _entry_chunk(
                x, e0 + lanes, total, incl, excl, ts, row, cols_ptr, vals_ptr, wu_ptr, wd_ptr, ds, d_ok, T, D, SLOTS
            )  # fmt: skip
    else:  # the interpreter cannot loop to a loaded bound: walk every slot, masked
        for e0 in range(0, T * SLOTS, SPLIT * CHUNK):
            acc += _entry_chunk(
                x, part * CHUNK + e0 + lanes, total, incl, excl, ts, row, cols_ptr, vals_ptr, wu_ptr, wd_ptr,
                ds, d_ok, T, D, SLOTS,
            )  # fmt: skip
    if tl.sum(overflow.to(tl.int32), axis=0) > 0:  # rare: one scalar test per row otherwise
        for tile in range(T):
            if tile % SPLIT == part:
                if tl.load(counts_ptr + row * T + tile) > SLOTS:
                    acc += _overflow_tile(
                        x, row, tile, wg_ptr, wu_ptr, wd_ptr, vals_ptr, hot_ptr, ds, d_ok, F, D, TILE_N,
                        CHUNK, HOT,
                    )  # fmt: skip
    if SPLIT == 1:
        tl.store(y_ptr + row * D + ds, acc.to(y_ptr.dtype.element_ty), mask=d_ok)
    else:
        # Each program stores its fp32 partial row; the last of the row's SPLIT programs to take a
        # ticket (per-row counters the gate kernel zeroed) adds the partials up in part order
        # (deterministic) and writes y: no fill before and no cast kernel after (decode graphs).
        tl.store(parts_ptr + (part.to(tl.int64) * n_rows + row) * D + ds, acc, mask=d_ok)
        tl.debug_barrier()  # every thread's partial before thread 0's release (bar.sync, then acq_rel)
        ticket = tl.atomic_add(tickets_ptr + row, 1, sem="acq_rel")  # release: the partial above
        if ticket == SPLIT - 1:
            y_row = tl.zeros((BLOCK_D,), dtype=tl.float32)
            for p in tl.static_range(SPLIT):
                y_row += tl.load(
                    parts_ptr + (p * n_rows + row) * D + ds, mask=d_ok, other=0.0, cache_modifier=".cg"
                )
            tl.store(y_ptr + row * D + ds, y_row.to(y_ptr.dtype.element_ty), mask=d_ok)


def _consumer_configs() -> list[triton.Config]:
    # CHUNK entries x 2 weight rows in flight per program vs registers ([CHUNK, D] bf16 slabs).
    return [triton.Config({"CHUNK": ch}, num_warps=w) for ch, w in ((8, 8), (16, 8), (8, 4), (4, 4))]


_tuned_consumer = autotune(configs=_consumer_configs(), key=["M_BUCKET", "D", "T", "SLOTS", "HOT"])(
    _row_consumer_kernel
)

DECODE_MAX_TOKENS = 64
DECODE_TILE_N, DECODE_SLOTS = 64, 32  # the TwELL format of the decode path (see _row_schedule)
# Programs per row of the consumer at decode sizes (None: decode_split(M)); set_decode_split overrides.
_settings: dict[str, int | None] = {"decode_split": None}


def decode_split(M: int) -> int:
    """Consumer programs per row at decode sizes (M <= DECODE_MAX_TOKENS), from H200 measurements
    (d_ff 5632, partial rows summed by the last program, per layer in an 8-layer CUDA graph, us at
    split 8 / 16: 1 token 20.2 / 21.0, 2: 17.8 / 18.8, 4: 22.0 / 19.9, 8: 21.2 / 19.4, 16: 26.7 / 22.8,
    32: 24.0 / 23.1, 48: 28.7 / 27.2, 64: 28.3 / 29.3; split 32 never better; NOTES round 10):
    16 from 4 to 48 tokens (too few rows to fill the SMs at 8), 8 otherwise."""
    if _settings["decode_split"] is not None:
        return _settings["decode_split"]
    return 16 if 4 <= M <= 48 else 8


def set_decode_split(split: int | None) -> None:
    """Benchmark switch: programs per row of the consumer at decode sizes (M <= 64); None: the default."""
    if split is not None and split < 1:
        raise ValueError(f"decode split={split} must be >= 1 (None restores the default)")
    _settings["decode_split"] = None if split is None else int(split)


# Hot-unit split: from this many tokens on, the hot units are computed densely (NOTES round 4: a unit is
# worth a tensor-core column when it fires on more than ~0.8% of tokens; under the paper-like
# log-normal rates that is the top ~500-700 of 5632 units). Set by measurement (H200, NOTES
# round 7, x dense for K = 0 / 512 / 1024 with the hot set counted exactly and chosen in one kernel):
# 8192 tokens 0.93 / 0.77 / 0.79 (eager launch overhead of the extra kernels dominates), 16384 1.22 /
# 1.36 / 1.39, 32768 1.29 / 1.40 / 1.43, 65536 1.24 / 1.36 / 1.36, 131072 1.40 / 1.58 / 1.59.
HOT_MIN_TOKENS = 16384
DEFAULT_HOT_UNITS = 1024


def default_hot_units(M: int, F: int) -> int:
    if M < HOT_MIN_TOKENS or interpreting():
        return 0
    return min(DEFAULT_HOT_UNITS, F // 4)


def _hot_part(x, w_up, w_down, hot):
    """y_hot of a TwELL hot gate (kernels.gate.twell_gate_hot); see _hot_y."""
    return _hot_y(x, w_up, w_down, hot.hot_idx, hot.g_hot)


def _hot_y(x, w_up, w_down, hot_idx, g_hot):
    """y_hot = (g_hot * (x @ w_up[hot]^T)) @ w_down[hot]: two tensor-core GEMMs on gathered rows."""
    u = x @ w_up.index_select(0, hot_idx).T
    u.mul_(g_hot)
    return u @ w_down.index_select(0, hot_idx)


def _row_schedule(x, w_gate, w_up, w_down, slots, tile_n, split, hot_units, return_stats):
    M, D = x.shape
    F = w_gate.shape[0]
    decode = M <= DECODE_MAX_TOKENS and not interpreting()
    if decode and tile_n is None and slots is None:
        # 64-wide tiles with 32 slots: the gate GEMV gets F/64 programs (88 at d_ff 5632, one an SM), each
        # streaming twice the rows of 32-wide tiles; a tile with more than 32 positives takes the exact
        # overflow path. H200, d_ff 5632, us per layer in an 8-layer graph, tiles 32 / 64 (NOTES round
        # 13): 1 token 17.3 / 16.6, 2: 21.0 / 17.4, 4: 19.9 / 18.6, 16: 22.8 / 21.9, 64: 28.3 / 27.8.
        tile_n, slots = DECODE_TILE_N, DECODE_SLOTS
    hot_units = check_hot_units(hot_units)
    if hot_units is None:
        hot_units = default_hot_units(M, F)
    hot_units = 0 if decode else min(hot_units, F)
    if hot_units:
        split = 1
    elif split is None:
        split = decode_split(M) if decode else 1
    # split > 1: per-row tickets of the consumer's programs, zeroed by the gate kernel
    tickets = torch.empty(M, dtype=torch.int32, device=x.device) if split > 1 else None
    if hot_units:
        hot = twell_gate_hot(x, w_gate, hot_units, slots=slots, tile_n=tile_n)
        gate = hot.gate
        y_hot = _hot_part(x, w_up, w_down, hot)
    else:
        gate = _twell_gate(x, w_gate, slots, tile_n, zero=tickets)
    T = gate.counts.shape[1]
    block_d = next_pow2(D)
    common = dict(
        T=T,
        T_PAD=next_pow2(T),
        D=D,
        BLOCK_D=block_d,
        TILE_N=gate.tile_n,
        SLOTS=gate.slots,
        SPLIT=split,
        DYNAMIC_LOOPS=not interpreting(),
        HOT=bool(hot_units),
    )
    args = (x, w_gate, w_up, w_down)
    extra = (hot.hot_pos, y_hot) if hot_units else (gate.counts, x)  # placeholders when not HOT
    y = torch.empty_like(x)
    # split > 1: fp32 partial rows [split, M, D], each written once (no fill)
    parts = torch.empty((split, M, D), dtype=torch.float32, device=x.device) if split > 1 else y
    split_bufs = (parts, tickets if tickets is not None else gate.counts)
    fmt = (gate.counts, gate.cols, gate.vals, *extra, *split_bufs, F, M, min(next_pow2(M), 1 << 17))
    if split == 1 and not interpreting():
        _tuned_consumer[(M, 1)](*args, y, *fmt, **common)
    else:
        chunk = min(16 if interpreting() else 4, next_pow2(gate.slots))
        _row_consumer_kernel[(M, split)](*args, y, *fmt, CHUNK=chunk, num_warps=4, **common)
    if not return_stats:  # three small kernels: ~8 of the 31 us of a 1-token call on the H200 (NOTES round 6)
        return y, None
    overflow_rows = (gate.counts > gate.slots).any(dim=1).sum(dtype=torch.int32)
    return y, InferenceStats(overflow_rows)


@torch.no_grad()
def twell_ffn_inference(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    *,
    schedule: str | None = None,
    slots: int | None = None,
    tile_n: int | None = None,
    split: int | None = None,
    hot_units: int | None = None,
    hot_prefix: int = 0,
    fused_tile: int | None = None,
    return_stats: bool = False,
):
    """y = (relu(x w_gate^T) * (x w_up^T)) @ w_down with TwELL kernels; no autograd, no host sync.

    schedule: "row", "csr" or "fused" (see the module doc; None: fused up to default_fused_tokens(d_ff)
    tokens, row at the other decode sizes or when a TwELL option below is given, csr otherwise; fused
    takes at most FUSED_MAX_TOKENS tokens and no TwELL option, and ignores the hot-unit ones).
    slots / tile_n: TwELL format of the row schedule (see kernels.gate); split: programs per row of its
    consumer (None: several at decode sizes, where few rows must fill the GPU; 1 otherwise).
    hot_units: K units computed densely on tensor cores (0: off; None: none for csr, DEFAULT_HOT_UNITS
    from HOT_MIN_TOKENS tokens on for row; ignored at decode sizes on a GPU).
    hot_prefix: P (a multiple of 32) -- the FIRST P units are computed densely on tensor cores straight
    from the gate GEMM's dense h, y_hot = (h[:, :P] * (x w_up[:P]^T)) @ w_down[:P], and the sparse part
    covers units P and up: no per-batch selection, no gathers, no copies. Exact for any P; fast when
    the units are ordered by firing rate (order_units / model.ffn reorder: the order is a property of
    the weights, so it is chosen once on calibration tokens). csr schedule only (None picks it above
    64 tokens); ignored at decode sizes, where the row schedule runs; not combined with hot_units.
    fused_tile: units of d_ff per program of the fused schedule, one of FUSED_TILES (None:
    decode_fused.FUSED_TILE_N); fewer units a program, more programs share its gate GEMV.
    With return_stats=True returns (y, InferenceStats): overflow_rows counts the rows whose positives
    did not all fit the format (row: a tile past its slots; csr: entries past the CSR's capacity),
    each computed exactly on its overflow path.
    """
    check_ffn_args(x, w_gate, w_up, w_down)
    check_kernel_device(x)
    defaults = (
        schedule is None and slots is None and tile_n is None and split is None and fused_tile is None
        and not return_stats
    )  # fmt: skip
    if defaults and torch.compiler.is_compiling():
        # One opaque node for torch.compile (no graph break: the ops around it stay in one graph).
        return torch.ops.twell.ffn_inference(
            x, w_gate, w_up, w_down, -1 if hot_units is None else hot_units, hot_prefix
        )
    if schedule not in (None, *SCHEDULES):
        raise ValueError(f"schedule={schedule!r} is not one of {SCHEDULES}")
    M = x.shape[0]
    twell_options = slots is not None or tile_n is not None or split is not None
    workspace = None
    if schedule == "fused" or (
        schedule is None and not twell_options and M <= default_fused_tokens(w_gate.shape[0])
    ):
        if M > FUSED_MAX_TOKENS:
            raise ValueError(
                f"schedule='fused' takes at most {FUSED_MAX_TOKENS} tokens, got {M}; use 'row' or None"
            )
        _reject_twell_options("fused", slots, tile_n, split)
        check_hot_units(hot_units)  # hot units are a large-batch device: ignored here, as on the row path
        if not torch.are_deterministic_algorithms_enabled():  # None while capturing on a stream without
            workspace = fused_workspace(x.device, x.shape[1])  # one: the row schedule instead
        elif schedule == "fused":
            raise RuntimeError(
                "schedule='fused' adds slices' fp32 partial rows with atomics (run-to-run bits may "
                "differ) and torch.use_deterministic_algorithms(True) is set; use schedule='row'"
            )
        schedule = "fused" if workspace is not None else "row"
    if schedule is None:  # a TwELL option asks for the row schedule
        schedule = "row" if M <= DECODE_MAX_TOKENS or twell_options else "csr"
    hot_prefix = check_hot_prefix(hot_prefix, w_gate.shape[0])
    if hot_prefix and check_hot_units(hot_units):
        raise ValueError(
            f"hot_prefix={hot_prefix} and hot_units={hot_units}: choose one way of computing hot units densely"
        )
    if fused_tile is not None and schedule != "fused":
        raise ValueError(
            f"fused_tile={fused_tile!r} is an option of schedule='fused' (here {schedule!r}), one of "
            f"{FUSED_TILES}; leave it out otherwise"
        )
    if schedule == "fused":  # every positive is used in-program: nothing can overflow
        y = fused_ffn_decode(x, w_gate, w_up, w_down, workspace, fused_tile)
        stats = InferenceStats(torch.zeros((), dtype=torch.int32, device=x.device)) if return_stats else None
    elif schedule == "csr":
        _reject_twell_options("csr", slots, tile_n, split)
        y, stats = _csr_schedule(x, w_gate, w_up, w_down, hot_units, hot_prefix, return_stats)
    else:
        if hot_prefix and x.shape[0] > DECODE_MAX_TOKENS:
            raise ValueError(f"hot_prefix={hot_prefix} needs schedule='csr' (or None), not 'row'")
        y, stats = _row_schedule(x, w_gate, w_up, w_down, slots, tile_n, split, hot_units, return_stats)
    return (y, stats) if return_stats else y


def _reject_twell_options(schedule: str, slots, tile_n, split) -> None:
    """The row schedule's TwELL options mean nothing to `schedule`: a ValueError naming the one given."""
    for name, value in (("slots", slots), ("tile_n", tile_n), ("split", split)):
        if value is not None:
            raise ValueError(
                f"{name}={value} is a TwELL option of schedule='row'; leave it out for '{schedule}'"
            )


def unit_order(fires: torch.Tensor) -> torch.Tensor:
    """The permutation that stores units most-firing first (fires: per-unit positive counts [F] on
    calibration tokens; ties keep index order). Apply it to w_gate, w_up and w_down rows alike (the FFN
    is unchanged) and pass hot_prefix=P: the first P units are then the hot ones."""
    if fires.dim() != 1:
        raise ValueError(f"fires must be per-unit counts [d_ff], got shape {tuple(fires.shape)}")
    return torch.argsort(fires, descending=True, stable=True)


@torch.library.custom_op("twell::ffn_inference", mutates_args=())
def _ffn_inference_op(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                      hot_units: int, hot_prefix: int) -> torch.Tensor:  # fmt: skip
    """twell_ffn_inference with its default schedule, as torch.compile sees it (hot_units < 0: None)."""
    return twell_ffn_inference(
        x, w_gate, w_up, w_down, hot_units=None if hot_units < 0 else hot_units, hot_prefix=hot_prefix
    )


@_ffn_inference_op.register_fake
def _(x, w_gate, w_up, w_down, hot_units, hot_prefix):
    return torch.empty_like(x)


def csr_capacity(M: int, F: int) -> int:
    """Entry slots of the csr schedule: 1/32 of d_ff per row on average (176 at 5632: ~6x the paper's
    ~29 active units per token; 6 bytes a slot). Positives past it are read from the dense h by the
    row kernel: exact, slower, counted in overflow_rows."""
    return M * max(32, F // 32)


def _prefix_pos(P: int, F: int, device) -> torch.Tensor:
    """int32 [F]: j for the first P units, -1 after (the row kernel's skip list for its h walk)."""
    key = (P, F, device)
    pos = _prefix_cache.get(key)
    if pos is None:
        pos = torch.arange(F, device=device, dtype=torch.int32)
        pos[P:] = -1
        _prefix_cache[key] = pos
    return pos


_prefix_cache: dict[tuple, torch.Tensor] = {}


def _csr_schedule(x, w_gate, w_up, w_down, hot_units, hot_prefix, return_stats):
    M, F = x.shape[0], w_gate.shape[0]
    hot_units = check_hot_units(hot_units)
    # No hot units by default: the row kernel gathers cheaply enough that they stopped paying (H200,
    # d_ff 5632, hot 0 / 1024: 1.082 / 1.072 ms at 16384 tokens, 7.694 / 7.858 ms at 131072; NOTES round 9).
    K = min(0 if hot_units is None else hot_units, F)
    P = hot_prefix
    h, bits = relu_gate_bits(x, w_gate)  # dense relu'd gate + positive bitmask (persistent GEMM on Hopper)
    hot_idx, split = hot_split(count_fires(bits), K, x) if K else (None, None)
    capacity = csr_capacity(M, F)
    if P:  # the prefix's positives leave the bitmask (one small strided fill), so the CSR skips them
        bits[:, : P // 32] = 0
        gu = gated_up(x, w_up, h, P)  # h[:, :P] * (x w_up[:P]^T), rounded once
    pat = build_pattern(h, bits, split, capacity, inference=True)
    del bits
    if K:
        y_hot, skip = _hot_y(x, w_up, w_down, hot_idx, split[2]), split[0]
    elif P:  # the prefix's dense part is added below
        y_hot, skip = None, _prefix_pos(P, F, x.device)
    else:
        y_hot = skip = None
    y = row_ffn_inference(pat.row_ptr, pat.cols, pat.gate, x, w_up, w_down, h, skip, y_hot, pat.long)
    if P:  # y += gu @ w_down[:P]: the prefix's second GEMM adds onto the row kernel's output (both
        # GEMMs in order: on a side stream, overlapping the row kernel, they were slower; NOTES round 12)
        y.addmm_(gu, w_down[:P])
    if not return_stats:
        return y, None
    return y, InferenceStats((pat.row_ptr[1:] > capacity).sum(dtype=torch.int32))
