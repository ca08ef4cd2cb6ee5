"""The training op's forward and backward replayed from CUDA graphs per layer, in eager and compiled steps.

An eager forward of twell_ffn issues ~7 Triton launches and ~40 PyTorch operators for ~1 ms of GPU work
at 16k tokens, and its host needs 1.5-1.9 ms to issue them (docs/RESULTS.md: the 1.5b step's forward
idles 23 ms a step waiting on it). `train.cuda_graph` replays a whole step, but not with torch.compile,
activation checkpointing or FSDP2. Here each layer's forward is captured once and replayed, whatever runs
around it: its host cost falls to two graph launches, a copy of the entry count and a few checks. The
backward is captured as one graph on the forward graph's saved state, read where the forward left it.

Two graphs a layer, so that the entry count is read without stalling the GPU (the sizes mode "estimate"
of train.py): `pattern` runs the gate GEMM, the unit counts, the hot units' choice and the CSR (its last
kernel writes the true entry count); the host queues the count's copy to pinned memory behind it, then
`products` (the sampled products, y, the L1 term), and waits for the copy only, while `products` runs.
A count above the graph's capacity means the results are wrong: the call returns None and its caller
redoes it exactly, as an eager call that misses its capacity does. Nothing wrong is ever returned.

Sizes. A graph holds a fixed entry capacity: the layer's need (train.py's history: the last count plus
1/8) plus GRAPH_HEADROOM, so that the count's drift from batch to batch does not recapture; a layer
captures anew when its need passes the capacity (after a miss) or falls below 1/SHRINK_BELOW of it
(activity falls as training goes on; a slot costs 16 bytes and the backward's column sort).

Memory. Each layer's graphs have a private pool holding what the forward returns and saves for backward
(the entry list at capacity, the hot units' gate and up values and weight rows, the statistics): the
state an eager step holds from its forward to its backward, held here between steps too. The dense
transients (the gate's h [M, d_ff] and bitmask, the hot units' h, y, dx and the weight gradients) live in
buffers shared by every layer of one shape (the layers run one after another on one stream; dx in two or
three that the layers take in turn, since a layer's grad_y is the dx of the layer above), allocated
outside the graphs; the backward graphs' intermediates share one pool.

Inputs. A graph reads its inputs where they were at capture ("direct"): a call whose x or weights sit
elsewhere captures anew with that input copied into a shared buffer before each replay ("copied", one
device copy: ~40 us for x at 16k x 2048 on an H100), which it keeps from then on. Compiled steps
allocate in the same order every step, so their inputs usually stay put.

y and the saved state come back as fresh tensors on the graph's memory (the small statistics as copies).
A replay overwrites the previous call's, so a layer replays only once every tensor on them is gone
(autograd frees the saved state after the backward; y is consumed by the residual add): storage use
counts say so. A call that finds them alive (two forward passes before one backward, a hook keeping y, a
bf16 leaf keeping its weight gradient as .grad) runs eagerly instead: slower, never wrong.

Opt-in: set_graphs(True), TWELL_OP_GRAPHS=1 or the trainer's train.twell_graphs=true. Measured on H100s
(docs/results/2026-12-07-c/): the op's eager fwd+bwd at 16,384 x 2048 x 5632 takes 2.39-2.56 ms with
them against 2.66-3.46 without (2.32-2.50x the eager dense step; one whole-step CUDA graph: 2.16-2.17 ms);
at 65,536 tokens they lose (10.2 against 8.9-9.1 ms). In the compiled trainer the sparse 1.5b twin ran
5.5% slower with them (62.0k against 65.6k tokens/s, the backward replayed 1,244 times in 1,422), the 0.5b
twin 3% slower (before the backward's fixes of 773d32e: 133 backward replays in 409). graph_stats() counts
captures, replays and fallbacks.
"""

from __future__ import annotations

import contextlib
import os
import warnings
import weakref

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from .train_format import PendingTotals

# Capacity of a captured layer over its need (the last count + 1/8 + 2048): three times as much, so that
# a layer misses only when its count triples from one call to the next (a 0.5b race on an H100 with twice
# as much recaptured ~8% of its calls as activity fell), and recaptures smaller once its need falls below
# an eighth of the capacity (a slot costs 16 bytes; the backward's column sort takes every slot).
GRAPH_HEADROOM = 2.0
SHRINK_BELOW = 8
_settings = {"on": os.environ.get("TWELL_OP_GRAPHS", "0") in ("1", "true", "True")}
_STATS = ("captures", "replays", "misses", "busy", "failed", "backward_captures", "backward_replays")
_stats = dict.fromkeys(_STATS, 0)
_graphs: WeakIdKeyDictionary = WeakIdKeyDictionary()  # layer key (its w_gate) -> _LayerGraphs
_by_row_ptr: dict[int, weakref.ref] = {}  # a layer graph's row_ptr address -> it (the backward's lookup)
_shared: dict = {}  # (device, shape, dtype, role) -> buffer shared by the layers of one shape
_capture_streams: dict[int, torch.cuda.Stream] = {}
# Memory pools that outlive the graphs captured into them: one per device that every layer's backward
# graph shares, one per layer that its successive forward captures reuse (no cudaMalloc / cudaFree, which
# waits for the device, at each recapture). A pool whose graphs are all gone is released by the allocator
# and its id must not be captured into again, so each keeps the first graph captured into it (never
# replayed).
_backward_pools: dict[int, list] = {}  # device -> [pool id, anchor graph]
_layer_pools: WeakIdKeyDictionary = WeakIdKeyDictionary()  # layer key -> [pool id, anchor graph]
_FAILED = object()  # in _graphs / a layer's backward: its capture failed, it runs eagerly


def set_graphs(on: bool) -> None:
    """Replay each layer's forward and backward from CUDA graphs on a GPU (True) or issue them eagerly
    (False, the default: see the module doc)."""
    _settings["on"] = bool(on)


def graphs_enabled() -> bool:
    return _settings["on"]


def graph_stats() -> dict:
    """Counts since the process started (or reset_graphs): forward captures and replays, misses (replays
    whose entries did not fit, redone exactly), busy (calls that found a previous call's outputs alive
    and ran eagerly), failed (captures that failed: that layer's pass eager from then on), and the
    backward's captures and replays."""
    return dict(_stats)


def reset_graphs() -> None:
    """Drop every captured graph, its memory and the shared buffers, and zero the counts."""
    _graphs.clear()
    _by_row_ptr.clear()
    _shared.clear()
    _backward_pools.clear()
    _layer_pools.clear()
    for k in _stats:
        _stats[k] = 0


def drop_graphs(layers) -> None:
    """Drop the graphs of these layers (their w_gate tensors)."""
    for key in layers:
        _graphs.pop(key, None)
        _layer_pools.pop(key, None)


def graph_capacity(need: int) -> int:
    """The entry capacity a layer is captured with when its eager sizing asks for `need` slots."""
    return int(need * (1 + GRAPH_HEADROOM)) // 1024 * 1024 + 1024


def capacity_fits(capacity: int, need: int) -> bool:
    """Whether a graph of `capacity` slots serves a call that needs `need`: large enough, and not more
    than SHRINK_BELOW times as large (then it holds memory and sorts slots for nothing: recapture)."""
    return need <= capacity <= SHRINK_BELOW * need


def _storage_ptr(t: Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _use_count(storage) -> int:
    return torch._C._storage_Use_Count(storage._cdata)


class _Held:
    """Storages the graphs write and the use counts they have while only this module holds them: a
    larger count means a tensor from an earlier call still uses one (alive)."""

    def __init__(self, tensors) -> None:
        by_address = {t.untyped_storage().data_ptr(): t for t in tensors if t.numel()}  # views: one storage
        self.storages = [t.untyped_storage() for t in by_address.values()]  # kept: part of the baseline
        self.baseline = [_use_count(s) for s in self.storages]

    def idle(self) -> bool:
        return all(_use_count(s) <= n for s, n in zip(self.storages, self.baseline))


def _shared_buffer(role: str, shape, dtype, device) -> tuple[Tensor, _Held]:
    key = (device, tuple(shape), dtype, role)
    if key not in _shared:
        buf = torch.empty(shape, dtype=dtype, device=device)
        _shared[key] = (buf, _Held([buf]))
    return _shared[key]


def _signature(t: Tensor) -> tuple:
    return t.data_ptr(), t.shape, t.stride(), t.dtype


class _Inputs:
    """Where a graph reads its inputs: where the caller's tensors were at capture ("direct": nothing is
    kept of them but their address and layout) or a buffer shared by the layers of one shape that each
    call copies its tensor into ("copied")."""

    def __init__(self, tensors, copied, roles) -> None:
        self.copied = tuple(copied)
        self.sources = [
            _shared_buffer(role, t.shape, t.dtype, t.device)[0] if c else None
            for t, c, role in zip(tensors, copied, roles)
        ]
        self.signatures = [None if c else _signature(t) for t, c in zip(tensors, copied)]
        self.layouts = [(t.shape, t.dtype) for t in tensors]

    def at_capture(self, tensors) -> list:
        return [s if s is not None else t for s, t in zip(self.sources, tensors)]

    def serve(self, tensors) -> bool:
        for t, sig, layout in zip(tensors, self.signatures, self.layouts):
            if (t.shape, t.dtype) != layout or (sig is not None and _signature(t) != sig):
                return False
        return True

    def moved(self, tensors) -> tuple[bool, ...]:
        """Which inputs the next capture copies: those copied now and those a call found elsewhere."""
        return tuple(c or _signature(t) != s for t, c, s in zip(tensors, self.copied, self.signatures))

    def load(self, tensors) -> None:
        for t, source in zip(tensors, self.sources):
            if source is not None:
                source.copy_(t)


@contextlib.contextmanager
def _capture_stream(device):
    """Captures inside run on the device's capture stream, after the work the current stream has queued
    (which the graphs' first replays follow anyway)."""
    stream = _capture_streams.setdefault(device.index, torch.cuda.Stream(device=device))
    stream.wait_stream(torch.cuda.current_stream(device))
    try:
        with torch.cuda.stream(stream):
            yield
    finally:
        torch.cuda.current_stream(device).wait_stream(stream)


@contextlib.contextmanager
def _capturing(graph, pool: list):
    """Capture into `graph` on the current stream, into `pool` ([id, anchor]: a new pool while the id is
    None, then anchored by this graph); a failure inside aborts the capture and re-raises."""
    # thread_local: CUDA calls from other threads (a data loader's pinning thread) do not invalidate it
    graph.capture_begin(pool=pool[0], capture_error_mode="thread_local")
    try:
        yield
    except BaseException:
        with contextlib.suppress(Exception):  # invalid anyway: the original error is the one to see
            graph.capture_end()
        raise
    graph.capture_end()
    if pool[0] is None:
        pool[:] = [graph.pool(), graph]


class _LayerGraphs:
    """One layer's captured forward (see the module doc) for one input layout, K and capacity, and the
    backward graph that reads its saved state."""

    def __init__(
        self,
        inputs,
        K: int,
        capacity: int,
        copied: tuple[bool, ...],
        stages,
        pool: list,
        backward_copied=None,
    ) -> None:
        x, w_gate = inputs[0], inputs[1]
        M, D, F = x.shape[0], x.shape[1], w_gate.shape[0]
        self.K, self.capacity = K, capacity
        self.inputs = _Inputs(inputs, copied, ("in0", "in1", "in2", "in3"))
        static = self.inputs.at_capture(inputs)
        work = (
            _shared_buffer("h", (M, F), x.dtype, x.device)[0],
            _shared_buffer("bits", (M, F // 32), torch.int32, x.device)[0],
        )
        y, self.y_held = _shared_buffer("y", (M, D), x.dtype, x.device)
        h_hot = _shared_buffer("h_hot", (M, K), x.dtype, x.device)[0] if K else None
        pattern_stage, product_stage = stages
        self.pattern, self.products = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with _capture_stream(x.device):
            with _capturing(self.pattern, pool):
                self.state = pattern_stage(*static[:2], K, capacity, True, work)
            with _capturing(self.products, pool):
                self.outputs = product_stage(*static, K, self.state, y_out=y, h_hot_out=h_hot)
        # state and outputs are held: every replay writes them
        self.count = self.state[3].totals[1:]  # the true entry count, written by the pattern graph
        self.held = _Held([*self.outputs[5:], *_tensors(self.state)])  # y: shared, checked by y_held
        self.backward = None  # captured at the first backward after a replay
        # Which backward inputs (grad_y, x, weights) its capture copies: what the layer's last backward
        # graph learned, else x and the weights as the forward found them (the backward reads the same
        # tensors), so that a forward recapture (capacity, a moved input) does not cost the backward an
        # extra eager step and capture to learn it again.
        self.backward_copied = backward_copied or (False, *copied)
        _by_row_ptr[self.outputs[5].data_ptr()] = weakref.ref(self)

    def serves(self, inputs, K: int, need: int) -> bool:
        return K == self.K and capacity_fits(self.capacity, need) and self.inputs.serve(inputs)

    def idle(self) -> bool:
        return self.held.idle() and self.y_held.idle()

    def replay(self, inputs) -> tuple:
        """The forward's outputs at the graph's capacity and the true entry count (waited for)."""
        self.inputs.load(inputs)
        self.pattern.replay()
        pending = PendingTotals(self.count)
        self.products.replay()
        nnz = pending.read()
        # The statistics (l1, row_active, unit_fires, overflow rows: small) are copied out, since callers
        # keep them past the next forward (the trainer's activity sums); y and the saved state are fresh
        # tensors on the graph's memory (autograd marks the tensors it returns, never ours).
        out = self.outputs
        return (out[0].detach(), *(t.clone() for t in out[1:5]), *(t.detach() for t in out[5:])), nnz

    def backward_for(self, args, impl):
        """dx, dW_gate, dW_up, dW_down for a backward whose saved state is this graph's (args: train.py's
        backward arguments), replayed, or eager (captured then for the next one); None: run it eagerly."""
        bw = self.backward
        if bw is _FAILED:
            return None
        inputs = (args[0], *args[2:6])  # grad_y, x and the weights; grad_l1 is always copied
        if bw is not None:
            idle = bw.idle()
            if idle and bw.inputs.serve(inputs):
                _stats["backward_replays"] += 1
                return bw.replay(inputs, args[1])
            # Its dx buffer in use (often by this very call's grad_y: the layer above's dx, since a layer
            # captured while the one above ran eagerly): captured anew on a free one. Other gradients
            # still in use: neither replay nor capture.
            if not idle and not (bw.weight_grads_idle() and _free_dx(inputs[1])[1].idle()):
                _stats["busy"] += 1
                return None
        # Eager on the graph's whole capacity (unused slots: zero gates, past the last column, so they
        # add nothing): the shapes the capture will have, every kernel compiled and tuned for them.
        out = impl(*args[:6], *self.outputs[5:])
        copied = bw.inputs.moved(inputs) if bw is not None else self.backward_copied
        self.backward = None
        try:
            self.backward = _BackwardGraph(self, inputs, args[1], copied, impl)
            _stats["backward_captures"] += 1
        except Exception as e:
            self.backward = _FAILED
            _failed("backward", e)
        return out


class _BackwardGraph:
    """A layer's backward on its forward graph's saved state: inputs grad_y, x and the weights (direct or
    copied), grad_l1 copied; dx and the weight gradients into buffers shared by the layers of one shape,
    the rest in one pool shared by every layer's backward graph (nothing else outlives a replay)."""

    def __init__(self, layer: _LayerGraphs, inputs, grad_l1, copied, impl) -> None:
        device = inputs[1].device
        self.inputs = _Inputs(inputs, copied, ("dy", "in0", "in1", "in2", "in3"))
        static = self.inputs.at_capture(inputs)
        self.grad_l1 = torch.empty((), dtype=grad_l1.dtype, device=device)
        shared = [_free_dx(inputs[1])]
        shared += [_shared_buffer(f"dw{i}", w.shape, w.dtype, device) for i, w in enumerate(inputs[2:])]
        # The buffers' own use counts (a _Held of this graph's would add a reference to each, which every
        # other layer's graph on them would then read as a tensor in use)
        self.outs, self.helds = [b for b, _ in shared], [h for _, h in shared]
        self.graph = torch.cuda.CUDAGraph()
        saved = layer.outputs[5:]
        args = (static[0], self.grad_l1, *static[1:], *saved)
        pool = _backward_pools.setdefault(device.index, [None, None])
        with _capture_stream(device), _capturing(self.graph, pool):
            impl(*args, outs=self.outs)

    def idle(self) -> bool:
        return all(held.idle() for held in self.helds)

    def weight_grads_idle(self) -> bool:
        return all(held.idle() for held in self.helds[1:])

    def replay(self, inputs, grad_l1) -> tuple:
        self.inputs.load(inputs)
        self.grad_l1.copy_(grad_l1)
        self.graph.replay()
        return tuple(t.detach() for t in self.outs)


def _free_dx(x: Tensor) -> tuple[Tensor, _Held]:
    """A dx buffer (x's shape) for a backward capture, of those shared by the layers of one shape, that
    nothing uses now: the layer above's dx is often still in use when this layer's backward runs (it is,
    or flows into, this layer's grad_y), so layers take turns on two (a third if both are in use)."""
    for i in range(3):
        buf, held = _shared_buffer(f"dx{i}", x.shape, x.dtype, x.device)
        if held.idle():
            return buf, held
    return buf, held  # all in use: the capture's replays find it busy and run eagerly


def graphed_backward(args, impl):
    """The backward replayed from the graph of the layer whose forward graph saved this state (args:
    train.py's backward arguments, row_ptr at 6), or None: the caller runs it eagerly (the forward ran
    eagerly, or a previous backward's outputs are still in use). The caller checks eligible() first."""
    ref = _by_row_ptr.get(args[6].data_ptr())
    layer = ref() if ref is not None else None
    # rows by its storage: a layer whose active units were all hot has no cold entries, and an empty
    # tensor's data_ptr() is 0 (the trainer's 0.5b layers, often: their backward never replayed)
    if layer is None or _storage_ptr(layer.outputs[6]) != _storage_ptr(args[7]):
        return None
    return layer.backward_for(args, impl)


def _failed(what: str, err: Exception) -> None:
    _stats["failed"] += 1
    warnings.warn(
        f"twell_ffn: capturing a layer's {what} in a CUDA graph failed ({type(err).__name__}: {err}); it "
        "runs eagerly (set_graphs(False) turns the graphs off everywhere)",
        stacklevel=4,
    )


def _tensors(obj):
    """The tensors in a nest of tuples (the pattern stage's state, a TrainPattern)."""
    if isinstance(obj, Tensor):
        yield obj
    elif isinstance(obj, tuple):
        for item in obj:
            yield from _tensors(item)


def fit_entries(out: tuple, nnz: int, capacity: int) -> tuple | None:
    """A capacity-sized forward's outputs (train.py's order) with the entry list (rows, cols, gate, up)
    cut to its nnz entries, or None if they did not fit (the caller redoes the call exactly)."""
    if nnz > capacity:
        return None
    rows, cols, gate, up = (t[:nnz] for t in out[6:10])
    return (*out[:6], rows, cols, gate, up, *out[10:])


def eligible(x: Tensor) -> bool:
    """Whether a call on x may take the graphs: on, on a GPU, not inside another capture."""
    return _settings["on"] and x.is_cuda and not torch.cuda.is_current_stream_capturing()


def graphed_forward(inputs, key, K: int, need: int, stages, eager):
    """The forward of the layer `key` on inputs (x, w_gate, w_up, w_down): replayed from its graphs when
    they serve this call, else eagerly by `eager(capacity)` (train.py's capacity-sized forward), after
    which the layer is captured for the next calls. Returns (outputs cut to the entry count, or None when
    the entries did not fit: the caller redoes the call exactly)."""
    graphs = _graphs.get(key)
    if graphs is _FAILED:
        return eager(need)
    if graphs is not None:
        if graphs.serves(inputs, K, need):
            if graphs.idle():
                outputs, nnz = graphs.replay(inputs)
                _stats["replays"] += 1
                fitted = fit_entries(outputs, nnz, graphs.capacity)
                _stats["misses"] += fitted is None
                return fitted
            _stats["busy"] += 1
            return eager(need)
        if not graphs.idle():  # a capture would not replace graphs whose outputs are still in use
            _stats["busy"] += 1
            return eager(need)
    capacity = graph_capacity(need)
    out = eager(capacity)  # this call's result; every kernel of the capacity compiled and tuned by it
    if out is None:
        return out
    copied = graphs.inputs.moved(inputs) if graphs is not None else (False,) * len(inputs)
    backward_copied = None
    if graphs is not None and isinstance(graphs.backward, _BackwardGraph):
        backward_copied = graphs.backward.inputs.copied
    _graphs.pop(key, None)  # the old graphs' memory goes before the new capture takes its own
    try:
        pool = _layer_pools.setdefault(key, [None, None])
        _graphs[key] = _LayerGraphs(inputs, K, capacity, copied, stages, pool, backward_copied)
        _stats["captures"] += 1
    except Exception as e:  # a kernel that cannot be captured here: this layer stays eager
        _graphs[key] = _FAILED
        _failed("forward", e)
    return out
