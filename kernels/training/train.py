"""twell_ffn: the training op of the ReLU-gated FFN, sparse in everything but the gate GEMM.

(One file of ~600 lines on purpose: the op's forward, backward, entry-list sizing and custom-op
registration share the per-layer size history and settings below; its kernels live beside it.)

Forward (x [M, D]; w_gate, w_up, w_down [F, D], w_down neuron-major):
  1. relu_gate_bits: the dense gate GEMM writes relu(x w_gate^T) and a bitmask of its positives;
     count_fires counts each unit's positives from the bitmask (unit_fires, the hot units' choice).
  2. build_pattern: bitmask -> exact CSR of the active entries (two small kernels that visit set bits
     only). A row holds all its positives, so no row overflows and nothing is dropped.
  3. u = x . w_up only at the entries (sampled dot); h = g * u; y = h w_down (row segments).
  4. L1 = sum |h| / M, row_active from the same entries and bitmask.
Saved for backward: x and the weights (inputs, saved by any FFN) plus per entry its row, column,
gate and up values (16 bytes an entry: ~8 MB at 16k tokens x 30 active, against ~550 MB of dense
[M, F] activations). The dense h is transient (freed once the CSR is built).
The entry list is sized without a host sync after a layer's first call (see SIZES).

Backward, on the same pattern:
  dh = dy . w_down at the entries (sampled dot) + grad_l1 * sign(h) / M
  du = dh * g, dg = dh * u   (g > 0 on every entry: the pattern is the ReLU mask)
  dx = dg w_gate + du w_up                                        (row segments)
  dw_gate = dg^T x, dw_up = du^T x, dw_down = h^T dy              (column segments: a CSC)
The CSC is a stable sort of the entries by column on the GPU (no host sync in backward).

Registered as torch.library custom ops (twell::ffn_train_fwd / _bwd) with fake kernels, so a
torch.compile'd model keeps the op in its graph (the entry count is an unbacked dynamic size). Eager
calls take a torch.autograd.Function over the same forward and backward (cheaper to dispatch).
"""

from __future__ import annotations

import contextlib
import os
import time

import torch
from torch import Tensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import _get_current_dispatch_mode
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from torch.utils.weak import WeakIdKeyDictionary

from .._common import check_ffn_args, check_hot_units, check_kernel_device
from ..bitmask import count_fires
from ..gate import relu_gate_bits
from ..inference.inference import default_hot_units
from ..reference import FFNOutput
from .train_format import HostCount, build_pattern, hot_split, to_csc
from .train_graph import drop_graphs, eligible, fit_entries, graphed_backward, graphed_forward
from .train_hot import hot_backward, hot_forward, scatter_hot_rows
from .train_rowfwd import row_dx, row_ffn_forward
from .train_sparse import ONE, SPLIT2, SPLIT3, entry_grads, segment_axpy, tune_length_buckets

# How the backward's sparse products are scheduled; selectable so one GPU run can compare them.
#   "fused3": dh by a sampled dot (w_down rows gathered per entry); one column pass gathers x and dy
#             rows and writes all three weight gradients.
#   "split":  as fused3, but dW_gate/dW_up (x pass) and dW_down (dy pass) in two lighter passes.
#   "auto" (default): the measured best on an H200: split from 65536 tokens without hot units (round
#             8: 11.12 vs fused3 11.71 ms at 64k), fused3 otherwise (64k with hot units: 9.13-9.65 vs
#             split 10.25-10.91 ms in three runs; 16k: within run-to-run spread, so the simpler,
#             fewer-launch variant; NOTES_TRAIN round 8).
BACKWARD_VARIANTS = ("fused3", "split")
# Forward: u and y fused in one program per row loading whole weight rows (train_rowfwd.py).
# Sizes of the entry list: "estimate" (default) sizes it from the layer's previous call plus a margin
# and checks the true count once the forward is issued (no host sync while the gate runs; a call that
# does not fit is redone exactly); "exact" waits for the count after the gate (the first call of a
# layer always does); "static" takes the estimate as a fixed size and never reads anything back, so
# a CUDA graph can hold the op: it is what a call under graph capture does whatever the setting. A
# static call whose entries do not fit cannot be redone: it adds 1 to
# static_misses(device), which a graph's owner checks after replays (non-zero: recompute eagerly).
# "deferred" is "static" for a training loop (eager or torch.compile'd): calls take the fixed size and
# never read back, each call's true count stays on the device, and the loop settles them all once per
# step (DeferredSizes.settle: one host sync) before it applies the gradients, redoing the step on a miss.
# Only deferred_sizes() selects it, so a call outside such a block can never return unchecked results.
# "late" sizes as "estimate" but the forward never waits: the entry list takes the estimate's slots and
# the positives past them count in y and L1 straight from the dense h (the row kernel's past-capacity
# walk), so the forward's outputs are exact whatever the count. The count (row_ptr[M]) is read when it
# is long computed: the layer's next call sizes itself from it, and the backward, which needs every entry,
# cuts the list to it or, on a miss, rebuilds the layer's entries exactly from x (_entries_checked).
# A late miss costs more than an estimate's (the forward walks the rows past the slots in h, and the
# backward redoes the gate), so late calls size as deferred ones do: a high-water mark with headroom 1
# (_deferred_capacity), about 16 bytes a slot more memory instead of a miss in most steps. A forward and
# its backward must run under the same setting.
SIZES = ("estimate", "exact", "static", "late")
# Headroom of a sized capacity over the entry count it is sized from (_with_margin). A CUDA graph's
# owner captures with a wider one after capacity misses (capacity_headroom, training/cuda_graph.py).
DEFAULT_HEADROOM = 0.125
MAX_HEADROOM = 2.0
_settings = {
    "backward": "auto", "hot_units": None, "sizes": "estimate", "headroom": DEFAULT_HEADROOM,
    "streams": {"1": True, "0": False}.get(os.environ.get("TWELL_SIDE_STREAM", ""), "auto"),
}  # fmt: skip
# Per layer (keyed by its w_gate tensor, held weakly) and (tokens, hot units): the next call's capacity.
_capacities: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _with_margin(nnz: int) -> int:
    """Entry capacity for the next call after one with nnz entries: + headroom (1/8 by default) + 2048,
    in 1024 steps (batches of a layer differ by a few %; a miss costs one redone pass, an extra slot 16
    bytes)."""
    return (nnz + int(nnz * _settings["headroom"]) + 2048) // 1024 * 1024


# Deferred calls (deferred_sizes) size wider: there a miss redoes the whole step, while a slot costs 16
# bytes and a few ns of the backward's per-entry work. On an H200 (paper_0.5b, 16k-token steps, L1 1e-3,
# activity falling) the eager margin of 1/8 missed in ~7 steps of 10, and twice the last step's count
# still in ~1 of 6: the cold entries left beside the hot units come in bursts (a batch with a few heavy
# rows holds several times the cold entries of the last). So a layer's capacity is a high-water mark:
# it shrinks by at most DEFERRED_DECAY per step (halving in ~35 steps) after the largest burst seen.
DEFERRED_HEADROOM = 1.0
DEFERRED_DECAY = 0.98


def _deferred_capacity(nnz: int, previous: int = 0) -> int:
    """A deferred call's capacity after a step whose largest count was nnz (previous: the capacity
    the step ran with)."""
    with capacity_headroom(DEFERRED_HEADROOM):
        fresh = _with_margin(nnz)
    return max(fresh, int(previous * DEFERRED_DECAY) // 1024 * 1024)


@contextlib.contextmanager
def capacity_headroom(frac: float):
    """Capacities sized inside the block take `frac` of the entry count as headroom instead of
    DEFAULT_HEADROOM (1/8). A graph's owner widens it after misses: early in training a layer's count
    can swing by more than 1/8 from one step to the next, and each miss of a graphed step costs an
    eager redo and a new capture."""
    if not 0 <= frac <= MAX_HEADROOM:
        raise ValueError(
            f"capacity headroom {frac!r} is out of range: give a fraction of the entry count in "
            f"[0, {MAX_HEADROOM}] (default {DEFAULT_HEADROOM})"
        )
    outer = _settings["headroom"]
    _settings["headroom"] = float(frac)
    try:
        yield
    finally:
        _settings["headroom"] = outer


def set_sizes(mode: str) -> None:
    """How the forward sizes its entry list: "estimate" (default, no host sync while the gate runs),
    "exact" (one sync per call), "static" (no read-back at all: CUDA graphs) or "late" (the forward
    never waits; the backward checks; see SIZES)."""
    if mode not in SIZES:
        raise ValueError(f"sizes {mode!r} is unknown; choose one of {SIZES}")
    _settings["sizes"] = mode


_misses: dict[torch.device, Tensor] = {}
# Calls outside a capture whose entries outgrew their sized capacity, since the process started: "redone"
# (estimate, or a graph replay's miss: the forward redone exactly) and "rebuilt" (late: the backward rebuilt
# the entries). Counted on the host, where each is found.
_entry_misses = {"redone": 0, "rebuilt": 0}


def entry_misses() -> dict:
    """Counts of calls whose entries did not fit their sized capacity (see _entry_misses); each one cost
    a redone forward (sizes estimate) or a rebuilt entry list in the backward (sizes late)."""
    return dict(_entry_misses)


# While a CUDA graph owner captures (record_static_sizes): each static call's (capacity, true entry
# count as an int32 [1] device view). The view lives in the graph's memory, so every replay rewrites it.
_static_sizes: list | None = None


@contextlib.contextmanager
def record_static_sizes():
    """Collects, for the static-size calls made inside the block (a CUDA graph capture), pairs
    (capacity, entries): `entries` an int32 [1] device tensor that each replay of the graph sets to the
    call's true entry count. A graph's owner reads them now and then (one sync) to find capacities far
    above what the layers use now (activations get sparser as training goes on) and captures anew."""
    global _static_sizes
    outer, _static_sizes = _static_sizes, []
    try:
        yield _static_sizes
    finally:
        _static_sizes = outer


# The calls of the open deferred_sizes() block (None outside one): (key, (M, K), capacity, entries).
_deferred: list | None = None


class DeferredSizes:
    """The training op's calls inside a deferred_sizes() block, to be checked with settle()."""

    def __init__(self) -> None:
        self.calls: list = []

    def settle(self, reduce=None, device: torch.device | str | None = None) -> bool:
        """Read the true entry counts of the calls made since the last settle (one host sync), size
        each layer's next calls from its largest count plus the margin, and return whether any call's
        entries did not fit its capacity: then its results, and everything computed from them
        (gradients included), are wrong, and the work must be redone (the new capacities fit the same
        inputs). `reduce`, for data-parallel loops: applied in place to an int32 [1] flag on `device`
        (all_reduce with MAX) so that every rank redoes together; every rank must call settle then."""
        calls = list(self.calls)
        self.calls.clear()
        counts = torch.cat([n for *_, n in calls]).tolist() if calls else []
        missed = False
        largest: dict = {}
        for (key, shape, capacity, _), n in zip(calls, counts):
            missed |= n > capacity
            largest[id(key), shape] = (key, max(n, largest.get((id(key), shape), (None, 0))[1]))
        for (_, shape), (key, n) in largest.items():
            history = _capacities.setdefault(key, {})
            history[shape] = _deferred_capacity(n, history.get(shape, 0))
        if reduce is not None:
            if device is None:
                if not calls:
                    raise ValueError("settle(reduce=...) without calls needs the device of the flag")
                device = calls[0][3].device
            flag = torch.tensor([int(missed)], dtype=torch.int32, device=device)
            reduce(flag)
            missed = bool(flag.item())
        return bool(missed)


@contextlib.contextmanager
def deferred_sizes():
    """Inside the block, the training op takes deferred sizes (see SIZES: a fixed capacity from the
    layer's history, nothing read back, so neither an eager nor a torch.compile'd step waits for the GPU
    in any layer). Yields a DeferredSizes whose settle() the caller runs once the work is issued (a
    training loop: after the step's backward passes, before the optimizer step) and redoes the work
    when it returns True. Calls left unsettled when the block ends are settled then; if one of them
    missed, RuntimeError (the results computed inside are wrong and nobody checked them)."""
    global _deferred
    sizes = DeferredSizes()
    outer, outer_mode = _deferred, _settings["sizes"]
    _deferred, _settings["sizes"] = sizes.calls, "deferred"
    try:
        yield sizes
    finally:
        _deferred, _settings["sizes"] = outer, outer_mode
    if sizes.calls and sizes.settle():
        raise RuntimeError(
            "twell_ffn: a call inside deferred_sizes() had more entries than its capacity and the block "
            "ended without settle(): the results computed inside are wrong. Call settle() after the work "
            "and redo it when settle() returns True"
        )


def forget_sizes(layers) -> None:
    """Drop the entry-count history of these layers (their w_gate tensors): their next calls are sized
    exactly. For a pass whose activity says nothing about the next ones (a warm-up on random inputs)."""
    layers = list(layers)
    for key in layers:
        _capacities.pop(key, None)
        _late_last.pop(key, None)
    drop_graphs(layers)


def oversized(capacity: int, entries: int) -> bool:
    """A fixed capacity more than twice what the next eager call would take for `entries`."""
    return capacity > 2 * _with_margin(entries)


def _capturing(x: Tensor) -> bool:
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def static_misses(device: torch.device | str) -> Tensor:
    """Static-size calls on `device` whose entries did not fit the layer's capacity (int32 0-dim tensor
    on the device, cumulative; `.zero_()` resets it). Their
    results are wrong: after replaying a CUDA graph that holds twell_ffn, a non-zero count means the
    step must be recomputed eagerly (which also raises the layer's capacity)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _misses:
        _misses[device] = torch.zeros((), dtype=torch.int32, device=device)
    return _misses[device]


# Hot units, with inference's default (kernels.inference.inference.default_hot_units: 1024 units from 16384
# tokens on a GPU, measured best for both ops): the units that fire most often in the batch (exact
# counts, one selection kernel) take every product on tensor cores (cuBLAS GEMMs on their gathered
# weight rows: ~75% of the entries at paper-like skew with 1024 of 5632 units); the sparse kernels
# keep the rest. Saved for backward: their gate and up values [M, K] each (x's dtype; 12% of a dense
# FFN's saved activations at K 1024 / d_ff 5632: saving u costs one GEMM less than recomputing it) and
# their gathered weight rows (12 MB at d_model 2048).


def set_backward_variant(name: str) -> None:
    if name not in BACKWARD_VARIANTS + ("auto",):
        raise ValueError(f"backward variant {name!r} is unknown; choose one of {BACKWARD_VARIANTS}")
    _settings["backward"] = name


def set_hot_units(k: int | None) -> None:
    """Hot units of the training op: None = the default (inference's default_hot_units), 0 = off,
    k > 0 = k units at every size (capped at d_ff)."""
    if k is not None and int(k) < 0:
        raise ValueError(f"hot units k={k} must be >= 0 (0 turns them off, None restores the default)")
    _settings["hot_units"] = None if k is None else int(k)


def set_streams(mode: bool | str) -> None:
    """Whether, on a GPU, the hot units' dense GEMMs run on a second CUDA stream beside the sparse
    kernels: "auto" (the default) only while a CUDA graph is captured, True always, False never (one
    stream, the same kernels in the same order, bit-identical results). Each fork and join costs the
    host an event record and a wait (~0.1 ms a layer on the H100 host of session (e)), more than the
    overlap saves the GPU (~0.1 ms a layer at 16k tokens, round 17) wherever the step is host-bound,
    i.e. outside a graph; a graph replays the fork and join for free."""
    if mode not in (True, False, "auto"):
        raise ValueError(f"streams {mode!r} is unknown; choose True, False or 'auto'")
    _settings["streams"] = mode


# The second stream of each device (made on first use). The hot units' GEMMs (tensor cores) and the
# cold entries' gather kernels (memory-bound, CUDA cores) share no operand, so they run concurrently;
# a CUDA graph captures the fork and join as parallel branches. Allocator safety: every stretch of work
# on the side stream starts by waiting for the caller's stream (_on) and the op joins it before
# returning (_join), so a block the side stream allocates and the caller's stream reads is only reused
# on the side stream after a later _on, which orders it after those reads.
_side_streams: dict[int, torch.cuda.Stream] = {}


def _side_stream(x: Tensor):
    """The side stream of x's device, or None (CPU tensors, streams turned off, or "auto" outside a
    CUDA graph capture: see set_streams)."""
    mode = _settings["streams"]
    if not (mode and x.is_cuda) or (mode == "auto" and not torch.cuda.is_current_stream_capturing()):
        return None
    if x.device.index not in _side_streams:
        _side_streams[x.device.index] = torch.cuda.Stream(device=x.device)
    return _side_streams[x.device.index]


@contextlib.contextmanager
def _on(side):
    """Work issued inside runs on `side` (None: on the caller's stream), after everything the caller's
    stream has issued so far."""
    if side is None:
        yield
        return
    side.wait_stream(torch.cuda.current_stream(side.device))
    with torch.cuda.stream(side):
        yield


def _join(side) -> None:
    if side is not None:
        torch.cuda.current_stream(side.device).wait_stream(side)


def hot_units_for(M: int, F: int, hot_units: int | None = None) -> int:
    """Hot units a call with M rows and d_ff F takes: `hot_units` when given, else the module setting
    (set_hot_units), else the default (inference's default_hot_units)."""
    k = check_hot_units(_settings["hot_units"] if hot_units is None else hot_units)
    if k is None:
        return default_hot_units(M, F)
    return min(k, F)


def _forward_sized(x, w_gate, w_up, w_down, key, K):
    """The forward at the size its layer's history and the sizes mode give (see SIZES), decided when the
    op runs, not when it is traced: a torch.compile'd graph takes the same sized paths as an eager call,
    and no history enters a trace. `key`: the layer's w_gate as its caller holds it (before an autocast
    cast), the key of its entry-count history. Returns y, l1, row_active, unit_fires, overflow count,
    then the 10 tensors saved for backward."""
    M = x.shape[0]
    capturing = _capturing(x)
    if not capturing and x.device not in _misses:  # made outside any capture, for a later one
        static_misses(x.device)
    mode = "static" if capturing else _settings["sizes"]
    # Under sizes "late" the layer's last call, long computed by now, sizes this one; not while a backward
    # runs: an activation-checkpointed block recomputes the call there and must get the same capacity
    # (torch.utils.checkpoint checks that the recomputed tensors have the saved ones' shapes).
    if mode == "late" and torch._C._current_graph_task_id() == -1:
        _settle_late(key, (M, K))
    history = _capacities.get(key)
    capacity = history.get((M, K), 0) if history and mode != "exact" else 0
    if mode == "static" and not capacity and capturing:
        raise RuntimeError(
            f"twell_ffn under CUDA graph capture needs the layer's entry count for {M} tokens"
            f"{f' and {K} hot units' if K else ''}: run the same step once eagerly before capturing"
            " (its count, plus a margin, becomes the graph's fixed capacity)"
        )
    if capacity and mode in ("static", "deferred"):  # fixed size, never read back
        deferred = _deferred if mode == "deferred" else None
        return _forward(x, w_gate, w_up, w_down, K, capacity, static=True, deferred=deferred, key=key)
    graphed = bool(capacity) and mode in ("estimate", "late") and eligible(x)
    if graphed:  # replayed from the layer's CUDA graphs
        out = graphed_forward(
            (x, w_gate, w_up, w_down), key, K, capacity, (_pattern_stage, _product_stage),
            lambda cap: _forward(x, w_gate, w_up, w_down, K, cap),
        )  # fmt: skip
    elif capacity and mode == "late":  # exact outputs at once; the count is read by the next call
        out = _forward(x, w_gate, w_up, w_down, K, capacity, late=True)
        _record_late(key, (M, K), out[5])
        return out
    else:
        out = _forward(x, w_gate, w_up, w_down, K, capacity) if capacity else None  # None: it did not fit
    if out is None:
        _entry_misses["redone"] += bool(capacity)
        out = _forward(x, w_gate, w_up, w_down, K, None)
    # The next call's capacity: this call's count plus a margin (static calls keep theirs); a high-water
    # mark for deferred calls and for late ones not replayed from graphs (a graph's capacity is its key).
    nnz = out[6].numel()
    if mode == "late":  # an exact or graphed call: its backward finds the count without a read-back
        _remember_count(out[5], HostCount(torch.tensor([nnz], dtype=torch.int32)))
    high_water = mode == "deferred" or (mode == "late" and not graphed)
    _capacities.setdefault(key, {})[(M, K)] = (
        _deferred_capacity(nnz, capacity) if high_water else _with_margin(nnz)
    )
    return out


@torch.library.custom_op("twell::ffn_train_fwd", mutates_args=())
def _ffn_train_fwd(
    x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, key: Tensor, hot_units: int
) -> tuple[
    Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
    Tensor, Tensor,
]:  # fmt: skip
    return _forward_sized(x, w_gate, w_up, w_down, key, hot_units)


# Late calls' counts: the last of each layer (keyed like _capacities) and (tokens, hot units), until it
# sizes the layer's next call; and every call's, by the storage of its row_ptr (saved for its backward),
# until its backward takes it. By storage, not by tensor: the backward may get another tensor over it
# (selective activation checkpointing's cache, a compiler's outputs). A weak reference to the storage
# tells a live entry from one whose storage is gone, and keeps that address from naming another meanwhile.
_late_last: WeakIdKeyDictionary = WeakIdKeyDictionary()
_late_by_list: dict[int, tuple[StorageWeakRef, HostCount]] = {}
_LATE_SWEEP = 256  # entries at which those of freed storages (forwards without a backward) are dropped


def _record_late(key, shape, row_ptr: Tensor) -> None:
    count = HostCount(row_ptr[-1:])
    _late_last.setdefault(key, {})[shape] = count
    _remember_count(row_ptr, count)


def _remember_count(row_ptr: Tensor, count: HostCount) -> None:
    if len(_late_by_list) >= _LATE_SWEEP:
        for cdata in [c for c, (ref, _) in _late_by_list.items() if ref.expired()]:
            del _late_by_list[cdata]
    storage = row_ptr.untyped_storage()
    _late_by_list[storage._cdata] = (StorageWeakRef(storage), count)


def _count_of(row_ptr: Tensor) -> HostCount | None:
    """The count its forward left for this row_ptr (taken: a second backward reads row_ptr itself)."""
    entry = _late_by_list.pop(row_ptr.untyped_storage()._cdata, None)
    return entry[1] if entry is not None and not entry[0].expired() else None


def _settle_late(key, shape) -> None:
    """Size the layer's next call from its last late call's entry count, if one is unread."""
    count = _late_last.get(key, {}).pop(shape, None)
    if count is not None:
        history = _capacities.setdefault(key, {})
        history[shape] = _deferred_capacity(count.read(), history.get(shape, 0))


def _entries_checked(args: tuple) -> tuple:
    """The backward's arguments (_ffn_train_bwd's order) with the entry list cut to its true count (the
    forward's, long computed): under sizes "late" the list keeps the estimate's slots, and a miss (more
    entries than slots) leaves some out; then the layer's entries are rebuilt exactly from its saved
    inputs (a gate GEMM and the CSR again: the cost of a redone forward, paid in the backward instead of
    a host wait in every forward). Other settings return the arguments as they are (their lists are cut
    or checked in the forward)."""
    x, w_gate, w_up, w_down, row_ptr = args[2:7]
    if _settings["sizes"] != "late" or _capturing(x):
        return args
    count = _count_of(row_ptr)  # None only for a call whose count is gone: then read row_ptr (a wait)
    nnz, capacity = count.read() if count is not None else int(row_ptr[-1]), args[8].numel()
    if nnz < capacity:
        return (*args[:7], *(t[:nnz] for t in args[7:11]), *args[11:])
    if nnz > capacity:
        _entry_misses["rebuilt"] += 1
        K = args[11].numel()  # the hot units the forward took (the same inputs choose the same ones)
        return (*args[:6], *_forward(x, w_gate, w_up, w_down, K, None)[5:])
    return args


def _forward(x, w_gate, w_up, w_down, K, capacity, static=False, deferred=None, key=None, late=False):
    """The whole forward. With a capacity the host issues it all without waiting and reads the true
    entry count at the end (long computed by then): None if the entries did not fit (the caller redoes
    it exactly, gate included: the dense h is not kept that long). `static`: the capacity is used as
    is and never checked on the host (no sync at all, so a CUDA graph can hold the op); the saved entry
    list keeps its unused slots (zero gates: no contribution) and a call whose entries did not fit
    adds 1 to static_misses(). `deferred` (a list, with `static`): the call's (key, (M, K), capacity,
    true entry count on the device) is appended to it instead, for DeferredSizes.settle. `late`: the
    capacity is used as is, never checked here, and the outputs are exact anyway (see SIZES)."""
    stage = _pattern_stage(x, w_gate, K, capacity, static, late=late)
    out = _product_stage(x, w_gate, w_up, w_down, K, stage)
    pat = stage[3]
    if deferred is not None:
        deferred.append((key, (x.shape[0], K), capacity, pat.totals[1:]))
    elif static:
        static_misses(x.device).add_(pat.totals[1] > capacity)
        if _static_sizes is not None:
            _static_sizes.append((capacity, pat.totals[1:]))
    elif pat.pending is not None:
        return fit_entries(out, pat.pending.read(), capacity)
    return out


def _pattern_stage(x, w_gate, K, capacity, static, work=None, late=False):
    """The forward up to the entry list: the dense gate GEMM writes relu(x w_gate^T) and its positive
    bitmask, every unit's positives over the batch are counted from the bitmask (unit_fires, and the hot
    units' choice), the hot columns go to g_hot (dense) and the cold ones to the CSR. Returns (fires,
    hot_idx, g_hot, pattern). `work`: (h, bits) buffers for the dense gate (op_graph's shared ones)."""
    h, bits = relu_gate_bits(x, w_gate, out=work)
    fires = count_fires(bits)
    if K:
        hot_idx, split = hot_split(fires, K, x)
        g_hot = split[2]
    else:
        hot_idx = torch.empty(0, dtype=torch.int64, device=x.device)
        g_hot = x.new_empty(0, 0)
        split = None
    # Exact sizes: the op's one host sync (the entry count) waits for the gate only; the hot units'
    # GEMMs are issued after it, so the GPU runs them while the host issues the rest.
    return fires, hot_idx, g_hot, build_pattern(h, bits, split, capacity, static=static, late=late)


def _product_stage(x, w_gate, w_up, w_down, K, stage, y_out=None, h_hot_out=None):
    """The forward from the entry list on: u at the entries, y and the L1 term, the hot units' dense
    share. Returns the forward's outputs (see _forward_sized), the entry list at its capacity.
    `y_out` / `h_hot_out`: buffers for y and the hot units' h (op_graph's shared ones)."""
    fires, hot_idx, g_hot, pat = stage
    side = _side_stream(x) if K else None
    if K:
        # The hot units' weight rows, gathered once and saved: [w_gate[hot]; w_up[hot]] serves the
        # backward's dx and dW_gate/dW_up GEMMs (one each), w_down[hot] both passes (12 MB at K 1024).
        # Outputs are allocated on the caller's stream; the side stream fills them while the row kernel
        # below gathers the cold entries.
        w_gu = x.new_empty(2 * K, x.shape[1])
        w_down_hot = x.new_empty(K, x.shape[1])
        u_hot = x.new_empty(x.shape[0], K)
        with _on(side):
            torch.index_select(w_gate, 0, hot_idx, out=w_gu[:K])
            torch.index_select(w_up, 0, hot_idx, out=w_gu[K:])
            torch.index_select(w_down, 0, hot_idx, out=w_down_hot)
            # h = g * u in x's dtype (as a dense FFN rounds it) and sum|h| per row in one pass. u is
            # saved for backward (32 MB at 16k x 1024: one GEMM less than recomputing it).
            torch.mm(x, w_gu[K:].T, out=u_hot)
            h_hot, l1_hot = hot_forward(g_hot, u_hot, out=h_hot_out)
    else:
        # outputs of a custom op may not alias each other
        u_hot, w_gu, w_down_hot = (x.new_empty(0, 0) for _ in range(3))
    # The cold entries: u per entry, y and sum |h| per row (rows without entries: 0).
    up, y, l1_rows = row_ffn_forward(
        pat.row_ptr, pat.cols, pat.gate, x, w_up, w_down, long=pat.long, out=y_out, past=pat.past
    )
    if K:  # the hot units' share on top: y += h_hot w_down[hot] (cuBLAS reads y in its epilogue)
        _join(side)
        y.addmm_(h_hot, w_down_hot)
        l1_rows.add_(l1_hot)
    l1 = l1_rows.mean()  # the L1 term: sum |h| / M
    return (
        y, l1, pat.row_active, fires, pat.totals[0],  # no row overflows the CSR: always 0, on the device
        pat.row_ptr, pat.rows, pat.cols, pat.gate, up, hot_idx, g_hot, u_hot, w_gu, w_down_hot,
    )  # fmt: skip


@_ffn_train_fwd.register_fake
def _(x, w_gate, w_up, w_down, key, hot_units):
    (M, D), F = x.shape, w_gate.shape[0]
    nnz = torch.library.get_ctx().new_dynamic_size()
    i32 = dict(dtype=torch.int32, device=x.device)
    K = hot_units
    return (
        x.new_empty(M, D), x.new_empty((), dtype=torch.float32), x.new_empty(M, **i32),
        x.new_empty(F, **i32), x.new_empty((), **i32), x.new_empty(M + 1, **i32),
        x.new_empty(nnz, **i32), x.new_empty(nnz, **i32), x.new_empty(nnz),
        x.new_empty(nnz, dtype=torch.float32), x.new_empty(K, dtype=torch.int64),
        x.new_empty(M, K) if K else x.new_empty(0, 0), x.new_empty(M, K) if K else x.new_empty(0, 0),
        x.new_empty(2 * K, D) if K else x.new_empty(0, 0), x.new_empty(K, D) if K else x.new_empty(0, 0),
    )  # fmt: skip


def _backward_variant(M: int, hot: bool) -> str:
    """The column pass's variant for M tokens: the setting, or under "auto" split only for large
    batches without hot units (NOTES_TRAIN round 8)."""
    variant = _settings["backward"]
    if variant == "auto":
        variant = "split" if M >= 65536 and not hot else "fused3"
    return variant


def _backward_impl(
    grad_y, grad_l1, x, w_gate, w_up, w_down, row_ptr, rows, cols, gate, up, hot_idx, g_hot, u_hot, w_gu,
    w_down_hot, outs=None,
):  # fmt: skip
    """dx, dw_gate, dw_up, dw_down from the upstream gradients of y and l1 and the saved state (written
    into `outs` when given: train_graph's shared buffers)."""
    M, F = x.shape[0], w_gate.shape[0]
    dy = grad_y.to(x.dtype).contiguous()
    grad_l1 = grad_l1.float()  # d(sum|h| / M)/dh = sign(h) / M times this: divided in the kernels
    hot = hot_idx.numel() > 0
    variant = _backward_variant(M, hot)
    # Per entry: dh = dy . w_down + grad_l1 / M * sign(h); d_gate = dh * u; d_up = dh * g; h. Then dx, the
    # longest kernel that needs no CSC, so the host issues the CSC's small ops while it runs.
    side = _side_stream(x) if hot else None
    if hot:  # the hot units' GEMMs on the side stream, beside the cold entries' kernels below
        with _on(side):
            d_gu, dw_gu_hot, dw_down_hot = _hot_backward(dy, grad_l1, x, g_hot, u_hot, w_gu, w_down_hot)
    d_gate, d_up, h = entry_grads(rows, cols, dy, w_down, gate, up, grad_l1, M)
    dx = torch.empty_like(x) if outs is None else outs[0]
    row_dx(row_ptr, cols, d_gate, d_up, w_gate, w_up, dx)
    if hot:  # dx += d_gu [w_gate[hot]; w_up[hot]], once the row kernel has written dx
        with _on(side):
            dx.addmm_(d_gu, w_gu)  # d_gu = [d_gate | d_up], the ReLU mask included
    # CSC: entries grouped by column (stable, so each column's rows stay in order: deterministic sums).
    col_ptr, rows_by_col, coefs = to_csc(rows, cols, (d_gate, d_up, h), F)
    if outs is None:
        dw_gate, dw_up, dw_down = (torch.empty_like(w) for w in (w_gate, w_up, w_down))
    else:
        dw_gate, dw_up, dw_down = outs[1:]
    if variant == "fused3":
        segment_axpy(col_ptr, rows_by_col, coefs, (x, dy), (dw_gate, dw_up, dw_down), SPLIT3)
    else:
        segment_axpy(col_ptr, rows_by_col, coefs[:2], (x,), (dw_gate, dw_up), SPLIT2)
        segment_axpy(col_ptr, rows_by_col, coefs[2:], (dy,), (dw_down,), ONE)
    if hot:  # the hot units' weight-gradient rows hold zeros from the column pass: overwritten
        _join(side)
        scatter_hot_rows(hot_idx, dw_gu_hot, dw_down_hot, dw_gate, dw_up, dw_down)
    return dx, dw_gate, dw_up, dw_down


@torch.library.custom_op("twell::ffn_train_bwd", mutates_args=())
def _ffn_train_bwd(
    grad_y: Tensor, grad_l1: Tensor, x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor,
    row_ptr: Tensor, rows: Tensor, cols: Tensor, gate: Tensor, up: Tensor, hot_idx: Tensor, g_hot: Tensor,
    u_hot: Tensor, w_gu: Tensor, w_down_hot: Tensor,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    return _backward_any(
        grad_y, grad_l1, x, w_gate, w_up, w_down, row_ptr, rows, cols, gate, up, hot_idx, g_hot, u_hot, w_gu,
        w_down_hot,
    )  # fmt: skip


def _backward_any(*args):
    """The backward replayed from its layer's graph when the forward was (train_graph.py), else eager."""
    out = graphed_backward(args, _backward_impl) if eligible(args[2]) else None
    return _backward_impl(*_entries_checked(args)) if out is None else out


def _hot_backward(dy, grad_l1, x, g_hot, u_hot, w_gu, w_down_hot):
    """The hot units' share of the gradients, as a dense FFN's autograd computes it (cuBLAS GEMMs on
    the weight rows the forward gathered, w_gu = [w_gate[hot]; w_up[hot]]; coefficients rounded to x's
    dtype): (d_gu = [d_gate | d_up] [M, 2K] for dx, dW of [w_gate[hot]; w_up[hot]], dW of w_down[hot])."""
    d_gu, h_hot = hot_backward(dy @ w_down_hot.T, g_hot, u_hot, grad_l1)
    return d_gu, d_gu.T @ x, h_hot.T @ dy


@_ffn_train_bwd.register_fake
def _(grad_y, grad_l1, x, w_gate, w_up, w_down, row_ptr, rows, cols, gate, up, *hot):
    return x.new_empty(x.shape), *(w.new_empty(w.shape) for w in (w_gate, w_up, w_down))


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:4], *output[5:])
    ctx.mark_non_differentiable(*output[2:])
    # No zero gradients for the 13 outputs nobody differentiates (statistics and saved state): autograd
    # would otherwise allocate and fill each one per backward (g_hot and u_hot: 32 MB each at 16k x
    # 1024), costing a launch and an allocation apiece on a host-bound step. _backward takes None.
    ctx.set_materialize_grads(False)


def _backward_args(ctx, grad_y, grad_l1) -> tuple:
    saved = ctx.saved_tensors  # unpacked once: activation checkpointing allows a single unpack
    x = saved[0]
    if grad_y is None:
        grad_y = torch.zeros_like(x)
    if grad_l1 is None:
        grad_l1 = torch.zeros((), dtype=torch.float32, device=x.device)
    return grad_y, grad_l1, *saved


def _backward(ctx, grad_y, grad_l1, *_unused):
    return (*torch.ops.twell.ffn_train_bwd(*_backward_args(ctx, grad_y, grad_l1)), None, None)  # key, K


_ffn_train_fwd.register_autograd(_backward, setup_context=_setup_context)


class _EagerFFN(torch.autograd.Function):
    """The same forward and backward as the custom ops, for eager calls, without the ops' dispatch
    (dispatcher round trips, a generated autograd.Function, output aliasing checks): ~30 us less host
    time per step on a CPU box, more on the H200 hosts, where an eager step is host-bound (the forward's
    host time outside the kernels' wrappers: 290 us with the custom op, 245 us with this Function, two
    nodes of NOTES_TRAIN round 11). torch.compile traces the custom ops. The forward takes ctx itself
    (no separate setup_context): Function.apply then binds no default arguments through
    inspect.signature on every call."""

    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down, key, hot_units):
        output = _forward_sized(x, w_gate, w_up, w_down, key, hot_units)
        _setup_context(ctx, (x, w_gate, w_up, w_down), output)
        return output

    @staticmethod
    def backward(ctx, grad_y, grad_l1, *_unused):
        return (*_backward_any(*_backward_args(ctx, grad_y, grad_l1)), None, None)


def twell_ffn(
    x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, *, hot_units: int | None = None
) -> FFNOutput:
    """Training op of the ReLU-gated FFN; autograd w.r.t. all four inputs (see module doc).

    hot_units: the K most-firing units of the batch computed on dense GEMMs (0: off; None: the module
    setting of set_hot_units, else inference's default_hot_units: 1024 from 16384 tokens on a GPU).

    Under autocast the operands are cast to the autocast dtype first (custom kernels take no part in
    autocast; the casts are differentiable, so fp32 master weights still receive gradients).
    """
    layer = w_gate  # the caller's tensor (before any autocast cast): the key of its entry-count history
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        x, w_gate, w_up, w_down = (t.to(dtype) for t in (x, w_gate, w_up, w_down))
    check_ffn_args(x, w_gate, w_up, w_down)
    check_kernel_device(x)
    K = hot_units_for(x.shape[0], w_gate.shape[0], hot_units)
    # Eager calls take the autograd.Function (cheaper to dispatch), torch.compile traces the custom op;
    # both size the entry list when they run (_forward_sized), from the layer's history. Under a
    # TorchDispatchMode (selective activation checkpointing among them: checkpoint_context) eager calls
    # take the custom op too, so that the mode sees the op as one operator and not its kernels' buffers.
    dispatched = torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None
    call = torch.ops.twell.ffn_train_fwd if dispatched else _EagerFFN.apply
    y, l1, row_active, unit_fires, n_overflow, *_saved = call(x, w_gate, w_up, w_down, layer, K)
    return FFNOutput(y=y, l1=l1, row_active=row_active, unit_fires=unit_fires, overflow_rows=n_overflow)


def keep_ffn_outputs(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Selective activation checkpointing policy: keep what the training op's forward returns (its
    output and its sparse saved state: ~16 bytes an active entry plus the hot units' gate and up values),
    recompute everything else. The recomputed forward of a checkpointed block then finds the op's results
    instead of running the gate GEMM, the CSR build and the sparse products a second time."""
    if op is torch.ops.twell.ffn_train_fwd.default:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


# torch.compile of a block checkpointed with checkpoint_context fails in torch 2.11 (inductor, compiling the
# backward: "Unsupported inductor graph input type: GreaterThan"; the 1.5b trainer on an H200 and a CPU
# reproduction, 2026-12-05) and compiles in 2.12.1 and 2.13 (CPU, inductor). Below this version compiled
# blocks are checkpointed plainly: the op runs again in the recomputation, as eager blocks do.
SELECTIVE_CHECKPOINT_MIN_TORCH = "2.12.1"


def compiled_selective_checkpointing() -> bool:
    """Whether this torch compiles blocks checkpointed with checkpoint_context (the trainer's choice, and
    the memory planner's)."""
    return torch.__version__ >= SELECTIVE_CHECKPOINT_MIN_TORCH


def checkpoint_context():
    """`context_fn` for torch.utils.checkpoint (non-reentrant) and checkpoint_wrapper around blocks with
    TwELL FFNs: keep_ffn_outputs as the policy. Works eagerly (twell_ffn dispatches the custom op under
    the policy's mode) and under torch.compile (the policy tags the traced op's outputs as saved)."""
    return create_selective_checkpoint_contexts(keep_ffn_outputs)


def warm_up(
    tokens: int, d_model: int, d_ff: int, device, *, hot_units: int | None = None, seed: int = 0
) -> float:
    """Run twell_ffn forward and backward on paper-like inputs of this shape (kernels/synthetic.py: ~29
    active units a token, 30% dead units, a long tail) so that every kernel the training op uses is
    compiled and autotuned before a model needs it: tuned on a random model's half-active gate, the
    kernels keyed by shape alone would keep configurations for the wrong regime. The column pass is also
    keyed by mean column length, which moves with activity: every one of its buckets is tuned here
    (train_sparse.tune_length_buckets), so that none is first met, and timed, in the middle of a run.
    Returns the seconds it took (synchronised)."""
    from ..synthetic import paper_like_ffn_inputs

    device = torch.device(device)
    start = time.perf_counter()
    x, w_gate, w_up, w_down = paper_like_ffn_inputs(tokens, d_model, d_ff, device=device, seed=seed)
    weights = [w.requires_grad_() for w in (w_gate, w_up, w_down)]
    x.requires_grad_()
    K = hot_units_for(tokens, d_ff, hot_units)
    # A layer's first call, exact (through the custom op a torch.compile'd graph runs; it records the
    # entry count), then the eager op at the size sized from it (the path of every later call).
    for compiled in (True, False):
        out = (
            torch.ops.twell.ffn_train_fwd(x, *weights, weights[0], K)
            if compiled
            else twell_ffn(x, *weights, hot_units=hot_units)
        )
        y, l1 = out[:2]
        torch.autograd.backward([y, l1], [torch.ones_like(y), torch.ones_like(l1)])
    modes = (SPLIT3,) if _backward_variant(tokens, K > 0) == "fused3" else (SPLIT2, ONE)
    for mode in modes:
        tune_length_buckets(d_ff, d_model, tokens, mode, device, dtype=x.dtype)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start
