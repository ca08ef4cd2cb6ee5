"""The TwELL gate: relu(x @ w_gate^T) as per-(row, column tile) lists of (column, value) entries.

The count stored per (row, tile) is the TRUE count of positives; entries past `slots` are not stored
and consumers must recompute such overflow tiles. This file holds the API (twell_gate, twell_gate_hot,
relu_gate_bits), the format's defaults and which path a call takes; the kernels are in
kernels/gate_gemm.py (the GEMMs), kernels/gate_compact.py (the compactions) and kernels/bitmask.py
(positive bitmasks, per-unit counts, hot-unit selection).

Paths: "fused" (compaction in the GEMM's epilogue, one kernel) or "two_kernel" (a dense relu GEMM that
also writes the positive bitmask, then a compaction kernel over the set bits: the GPU default above 64
rows). set_gate_variant switches them for benchmarks and tests.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import torch

from ._common import cdiv, check_kernel_device, check_x_weight, interpreting, tma_ready
from .bitmask import count_fires, pack_positive_bits, select_hot_units
from .gate_compact import launch_compact, launch_compact_bits
from .gate_gemm import _launch_gemm, _variant, launch_relu_bits_persistent


class TwELLGate(NamedTuple):
    counts: torch.Tensor  # int32 [M, T]: true positives per (row, tile); > slots means overflow
    cols: torch.Tensor  # int16/int32 [M, T, S]: absolute column of entry s (valid for s < min(count, S))
    vals: torch.Tensor  # [M, T, S] dtype of x: gate value of entry s
    tile_n: int  # column-tile width; T = ceil(F / tile_n)
    slots: int  # S


class HotGate(NamedTuple):
    gate: TwELLGate  # the cold part: entries and counts of non-hot columns only
    hot_idx: torch.Tensor  # int64 [K] sorted hot columns
    hot_pos: torch.Tensor  # int32 [F]: position of column c in hot_idx, -1 if cold
    g_hot: torch.Tensor  # [M, K] dtype of x: relu gate values of the hot columns (zeros included)
    fires: torch.Tensor  # int32 [F]: positives of every unit over the batch (hot and cold, all rows)


def default_tile_n(M: int, F: int) -> int:
    """Format width of twell_gate: 256 (the paper's) for large batches; narrower tiles give small batches
    more programs (32 at M <= 64). The FFN's decode path picks its own format
    (kernels.inference.inference.DECODE_TILE_N: 64-wide tiles measured faster there, NOTES round 13)."""
    if interpreting():
        return 64
    if M >= 2048 and F >= 2048:
        return 256
    if M >= 256:
        return 128
    return 64 if M > 64 else 32


def default_slots(tile_n: int) -> int:
    # ~1/8 of the tile: 32 entries at tile_n 256, far above the ~1.3 a typical row puts in a tile.
    return max(8, tile_n // 8)


def set_gate_variant(
    loads: str | None = None,
    sub_n: int | None = None,
    path: str | None = None,
    compact: str | None = None,
    bits_gemm: str | None = None,
) -> None:
    """Benchmark switch: loads "tma" | "ptr" | None (device default), sub_n (columns per compaction
    step inside a format tile: 16-256, None: gate_gemm.DEFAULT_SUB_N), path "fused" |
    "two_kernel" | None (device default), compact "bits" | "scan" | None (bits) for the two-kernel path
    and twell_gate_hot, bits_gemm "tiles" | "persistent" | None (the device default): the kernel of the
    dense_bits GEMM (one program per output tile, or launch_relu_bits_persistent)."""
    if loads not in (None, "tma", "ptr"):
        raise ValueError(f"loads={loads!r} must be 'tma', 'ptr' or None")
    if sub_n not in (None, 16, 32, 64, 128, 256):
        raise ValueError(f"sub_n={sub_n!r} must be 16, 32, 64, 128, 256 or None")
    if path not in (None, "fused", "two_kernel"):
        raise ValueError(f"path={path!r} must be 'fused', 'two_kernel' or None")
    if compact not in (None, "bits", "scan"):
        raise ValueError(f"compact={compact!r} must be 'bits', 'scan' or None")
    if bits_gemm not in (None, "tiles", "persistent"):
        raise ValueError(f"bits_gemm={bits_gemm!r} must be 'tiles', 'persistent' or None")
    _variant.update(loads=loads, sub_n=sub_n, path=path, compact=compact, bits_gemm=bits_gemm)


def launch_gate(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    counts: torch.Tensor,
    cols: torch.Tensor,
    vals: torch.Tensor,
    tile_n: int,
    slots: int,
    *,
    epilogue: str = "twell",
    dense: torch.Tensor | None = None,
    zero: torch.Tensor | None = None,
) -> None:
    """Launch the gate kernel into given buffers (no checks: twell_gate and the benchmarks call this).
    epilogue "twell" takes the path of set_gate_variant: fused, or two_kernel (dense relu into a
    temporary [M, F] buffer, freed on return, then a compaction kernel of kernels/gate_compact.py). `zero`: an int32 tensor
    that must read 0 once the gate is done; the fused kernel zeroes it on the way when it is small
    (decode: no fill node in a graph), otherwise it is filled first."""
    if zero is not None and zero.numel() > 1 << 16:  # one program's store: keep it small
        zero.zero_()
        zero = None
    M = x.shape[0]
    F = w_gate.shape[0]
    # Measured on an H200 (docs/results/bench_gate_round3.txt): the two-kernel path beats the fused
    # epilogue at 16384 (0.85 vs 0.99 ms) and 131072 tokens (6.64 vs 7.74 ms), so it is the GPU
    # default until the fused epilogue reaches mainloop cost; the interpreter keeps the fused one.
    path = _variant["path"] or ("fused" if interpreting() else "two_kernel")
    if epilogue == "twell" and path == "two_kernel" and M > 64:
        if zero is not None:
            zero.zero_()
        h = torch.empty((M, F), dtype=x.dtype, device=x.device)
        bits = _dense_pass(x, w_gate, h, counts, cols, vals, tile_n, slots)
        _compact_pass(h, bits, counts, cols, vals, tile_n, slots)
        del h, bits  # back to the caching allocator at once: the dense pass is transient
        return
    _launch_gemm(x, w_gate, counts, cols, vals, tile_n, slots, epilogue, dense, zero)


def _dense_pass(x, w_gate, h, counts, cols, vals, tile_n, slots, bits=None):
    """Two-kernel path, first pass: dense relu GEMM into h; with compact "bits" (set_gate_variant, the
    default) it also returns the positive bitmask [M, F // 32] for _compact_bits_kernel (written into
    `bits` when given), else None."""
    M, F = h.shape
    if (_variant["compact"] or "bits") == "scan":
        _launch_gemm(x, w_gate, counts, cols, vals, tile_n, slots, "dense", h)
        return None
    if bits is None:
        bits = torch.empty((M, F // 32), dtype=torch.int32, device=h.device)
    if _bits_gemm(x, w_gate, h) == "persistent":
        launch_relu_bits_persistent(x, w_gate, h, bits)
        return bits
    try:
        _launch_gemm(x, w_gate, bits, cols, vals, tile_n, slots, "dense_bits", h)
    except Exception as e:  # a compile failure on a new GPU/Triton: stay correct on the old path
        warnings.warn(
            f"dense_bits gate epilogue failed ({type(e).__name__}: {e}); using compact='scan'", stacklevel=2
        )
        _variant["compact"] = "scan"
        _launch_gemm(x, w_gate, counts, cols, vals, tile_n, slots, "dense", h)
        return None
    return bits


def _bits_gemm(x, w_gate, h) -> str:
    """Which kernel runs the dense_bits GEMM: the persistent one needs TMA (Hopper or later, 16-byte
    aligned bases) and more rows than the decode regime's GEMV."""
    choice = _variant["bits_gemm"] or "persistent"  # measured faster on an H200 (PERSISTENT_CONFIGS)
    if choice == "persistent":
        # 16-bit operands only: every PERSISTENT_CONFIGS tile needs more shared memory than a Hopper SM
        # has in fp32 (128x256x64 in 3 stages: 294 KB of 227 KB), and the autotuner's key (descriptors
        # carry no dtype) would hand fp32 calls a configuration tuned in bf16.
        if not (tma_ready(x, w_gate, h) and x.shape[0] > 64 and x.element_size() == 2):
            return "tiles"
    return choice


def _compact_pass(
    h, bits, counts, cols, vals, tile_n, slots, hot_pos=None, g_hot=None, hot_bits=None
) -> None:
    if bits is None:
        launch_compact(h, counts, cols, vals, tile_n, slots, hot_pos, g_hot)
        return
    launch_compact_bits(h, bits, counts, cols, vals, tile_n, slots, hot_pos, g_hot, hot_bits)


def _format(M: int, F: int, slots: int | None, tile_n: int | None) -> tuple[int, int]:
    tile_n = default_tile_n(M, F) if tile_n is None else int(tile_n)
    if tile_n not in (32, 64, 128, 256):
        raise ValueError(f"tile_n={tile_n} is not supported; use 32, 64, 128 or 256")
    slots = default_slots(tile_n) if slots is None else int(slots)
    if not 1 <= slots <= tile_n:
        raise ValueError(f"slots={slots} must be in [1, tile_n={tile_n}]")
    return tile_n, slots


def _format_buffers(x: torch.Tensor, F: int, tile_n: int, slots: int):
    """Uninitialised (counts, cols, vals) of a TwELL gate of x's rows (the kernels write every entry read)."""
    M, T = x.shape[0], cdiv(F, tile_n)
    col_dtype = torch.int16 if F <= torch.iinfo(torch.int16).max else torch.int32
    counts = torch.empty((M, T), dtype=torch.int32, device=x.device)
    cols = torch.empty((M, T, slots), dtype=col_dtype, device=x.device)
    vals = torch.empty((M, T, slots), dtype=x.dtype, device=x.device)
    return counts, cols, vals


def twell_gate(
    x: torch.Tensor, w_gate: torch.Tensor, *, slots: int | None = None, tile_n: int | None = None
) -> TwELLGate:
    """relu(x @ w_gate^T) in TwELL form (see TwELLGate); counts may exceed slots (overflow tiles)."""
    check_x_weight(x, w_gate, "w_gate")
    check_kernel_device(x)
    return _twell_gate(x, w_gate, slots, tile_n)


def _twell_gate(x, w_gate, slots, tile_n, zero=None) -> TwELLGate:
    """twell_gate after its checks; `zero` see launch_gate."""
    M, F = x.shape[0], w_gate.shape[0]
    tile_n, slots = _format(M, F, slots, tile_n)
    counts, cols, vals = _format_buffers(x, F, tile_n, slots)
    launch_gate(x, w_gate, counts, cols, vals, tile_n, slots, zero=zero)
    return TwELLGate(counts, cols, vals, tile_n, slots)


def relu_gate_bits(
    x: torch.Tensor, w_gate: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h = relu(x @ w_gate^T) [M, F] in x's dtype, its positive bitmask int32 [M, F // 32]) from one
    GEMM (the dense_bits epilogue): the first pass of the training op's gate (kernels/training/train_format.py
    compacts it into a CSR). F must be a multiple of 32. `out`: (h, bits) buffers of those shapes to write
    into (the training op's graphed forward keeps one pair per shape for all layers)."""
    check_x_weight(x, w_gate, "w_gate")
    check_kernel_device(x)
    M, F = x.shape[0], w_gate.shape[0]
    if F % 32:
        raise ValueError(f"d_ff={F} must be a multiple of 32 for the gate's bitmask")
    tile_n, slots = _format(M, F, None, None)
    if out is not None:
        h, bits = out
        if h.shape != (M, F) or h.dtype != x.dtype or bits.shape != (M, F // 32) or bits.dtype != torch.int32:
            raise ValueError(
                f"relu_gate_bits out=: h must be [{M}, {F}] {x.dtype} and bits [{M}, {F // 32}] int32, got "
                f"{tuple(h.shape)} {h.dtype} and {tuple(bits.shape)} {bits.dtype}"
            )
    else:
        h, bits = torch.empty((M, F), dtype=x.dtype, device=x.device), None
    # counts/cols/vals: unused by these epilogues
    bits = _dense_pass(x, w_gate, h, h, h, h, tile_n, slots, bits=bits)
    return h, pack_positive_bits(h) if bits is None else bits


def twell_gate_hot(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    hot_units: int,
    *,
    slots: int | None = None,
    tile_n: int | None = None,
) -> HotGate:
    """Gate for the hot-unit split: dense relu pass, each unit's positives over the batch counted
    exactly from the pass's bitmask, the hot_units most frequent units (one selection kernel, no
    host sync), then one compaction pass that writes the hot columns densely to g_hot and the cold ones
    in TwELL form (counts = cold positives only). Any hot set gives exact results; the counts only
    decide which units are worth tensor cores."""
    check_x_weight(x, w_gate, "w_gate")
    check_kernel_device(x)
    M, D = x.shape
    F = w_gate.shape[0]
    K = int(hot_units)
    if not 1 <= K <= F:
        raise ValueError(f"hot_units={K} must be in [1, d_ff={F}]")
    tile_n, slots = _format(M, F, slots, tile_n)
    counts, cols, vals = _format_buffers(x, F, tile_n, slots)
    h = torch.empty((M, F), dtype=x.dtype, device=x.device)
    bits = _dense_pass(x, w_gate, h, counts, cols, vals, tile_n, slots)
    # Exact per-unit counts of the batch: from the bitmask (1/16 of h's bytes), or from h on the scan path.
    fires = count_fires(bits) if bits is not None else (h > 0).sum(0, dtype=torch.int32)
    hot_idx, hot_pos, hot_bits = select_hot_units(fires, K)
    g_hot = torch.empty((M, K), dtype=x.dtype, device=x.device)
    _compact_pass(h, bits, counts, cols, vals, tile_n, slots, hot_pos, g_hot, hot_bits)
    del h, bits
    return HotGate(TwELLGate(counts, cols, vals, tile_n, slots), hot_idx, hot_pos, g_hot, fires)
