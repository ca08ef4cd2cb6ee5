"""train.cuda_graph=true: each micro-batch's forward, loss and backward replayed from one CUDA graph.

Why: an eager micro-batch issues every kernel from Python, tens of microseconds of host time each.
A TwELL layer issues ~50 of them for ~2 ms of GPU work at 16k tokens, so on the H200 nodes an eager
step waits on the host (docs/KERNELS.md). A replay issues the whole micro-batch at once.

What is captured: the model's forward under bf16 autocast, CE (fp32) + l1_coef * L1 with l1_coef a
device scalar refilled each step, and the backward, which accumulates into the parameters' .grad.
Those gradient tensors are static: allocated before the capture and zeroed in place between steps
(never set to None). Not captured: the host-to-device batch copy (copied into static input buffers),
clipping, AdamW, dead-unit re-initialisation (all in place on the same parameters) and the statistics.

TwELL layers inside the capture take fixed entry capacities (kernels.training.train sizes "static": the
count of the warm-up call plus a margin). A micro-batch whose entries do not fit its capacity gives
wrong results and is counted on the device (kernels.training.train.static_misses). The trainer reads that
count once per step, before clipping and the optimizer: when it is non-zero, the step's gradients
and statistics are dropped, the step is redone eagerly (which records the larger counts), and the
graph is captured again on the next step. Nothing wrong reaches the weights.

The capacities' headroom over the warm-up's counts starts at kernels.training.train's 1/8 and doubles (up to
2, i.e. three times the count) after each step with a miss, so a layer whose count keeps swinging
(early training, dead units re-initialised) stops missing after a few steps; each size check that
finds a clean step halves it back toward 1/8 (a wide capacity costs work: the sparse kernels' grids
follow it inside a graph).

Captured again when: the FFN routing changes (ffn_impl="auto"), after a miss, when something replaced
a parameter's .grad tensor, or when a check (`check_sizes`, every model.twell_check_interval steps:
one sync) finds a TwELL layer whose capacity is more than twice what it now needs: a capacity fixed
early in training, while activations are still dense, would otherwise keep sizing every sparse kernel
(their work follows the capacity inside a graph) long after the layer turned sparse.

Under DDP (`torchrun`, train.parallel=ddp): the graph holds the plain model's micro-batch, no
collective. DDP keeps its parameters' gradient accumulators alive, and they belong to the stream DDP
was built on: the trainer builds it on a side stream, and the warm-ups, the capture and eager redos
run there (a capture on another stream would be invalidated by the backward's stream sync). The
static gradients are views into one flat buffer per dtype; after the step's replays the ranks agree
on misses (one all-reduce of the miss count: a miss on any rank redoes the step eagerly on every
rank, through DDP) and all-reduce the flat buffers (average), then clip and step as DDP would. The
reduction is not overlapped with the backward, as DDP's buckets are: one all-reduce of the gradients
per step, after the last micro-batch.

Limits (checked in Trainer, each with its message): a CUDA device, one process or DDP (FSDP2's
gathers and reduce-scatters are not captured), no torch.compile and no activation checkpointing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

log = logging.getLogger(__name__)

# Eager micro-batches before each capture, on a side stream (PyTorch's capture recipe): the first
# records the TwELL layers' entry counts, the second runs at the capture's fixed sizes so that every
# Triton kernel is autotuned for them (autotuning cannot run inside a capture).
WARMUP_MICRO_BATCHES = 2


class GraphedMicroStep:
    """Captures `loss_fn(input_ids, labels, l1_coef) -> (loss, ce, out)` plus its backward; replays it.

    `run_step` returns per micro-batch (ce, l1, stats) copies, or None when a TwELL layer's entries did
    not fit (the caller redoes the step eagerly; the gradients hold garbage and must be zeroed)."""

    def __init__(
        self,
        params: list[nn.Parameter],
        loss_fn: Callable,
        grad_accum: int,
        device: torch.device,
        world_size: int = 1,
        stream: torch.cuda.Stream | None = None,
    ):
        import twell.kernels.training.train as kt  # CUDA only: triton is there

        self._kt = kt
        self.params, self.loss_fn, self.grad_accum, self.device = params, loss_fn, grad_accum, device
        self.world_size = world_size  # > 1: DDP; the gradients are all-reduced after the replays
        # The stream of the warm-ups and the capture: DDP's (see Trainer), whose gradient accumulators
        # it keeps alive belong to the stream it was built on; None: a new side stream each capture.
        self.stream = stream
        self._flats: list[torch.Tensor] = []  # DDP: the static gradients' storage, one buffer per dtype
        self.graph: torch.cuda.CUDAGraph | None = None
        self.captures = 0  # graphs captured so far
        self.redone_steps = 0  # steps redone eagerly after a capacity miss
        self._routing = None
        self._grads: list[torch.Tensor] = []
        self._sizes: list = []  # (capacity, entries on the device) per TwELL call in the graph
        self.headroom = kt.DEFAULT_HEADROOM  # of the next capture's capacities over the warm-up's counts

    def zero_grads(self) -> None:
        """Zero the static gradients in place (the graph writes into these very tensors)."""
        grads = [p.grad for p in self.params if p.grad is not None]
        if grads:
            torch._foreach_zero_(grads)

    def run_step(
        self,
        batches: list[tuple[torch.Tensor, torch.Tensor]],
        l1_coef: float,
        routing,
        check_sizes: bool = False,
    ) -> list | None:
        """Replay every micro-batch of a step (gradients accumulate in the parameters' .grad).
        check_sizes: afterwards compare the TwELL capacities with the last replay's entry counts."""
        if routing != self._routing or any(p.grad is not g for p, g in zip(self.params, self._grads)):
            self.graph = None  # another routing, or .grad replaced: the captured addresses are stale
        if self.graph is None:
            self._capture(batches[0], l1_coef)
            self._routing = routing
        self._l1_coef.fill_(l1_coef)
        misses = self._kt.static_misses(self.device)
        misses.zero_()
        results = []
        for input_ids, labels in batches:
            self._ids.copy_(input_ids)
            self._labels.copy_(labels)
            self.graph.replay()
            ce, l1, stats = self._outputs
            # copies: the next replay overwrites the static outputs
            results.append(
                (ce.clone(), l1.clone(), type(stats)(**{k: _copy(v) for k, v in vars(stats).items()}))
            )
        if self.world_size > 1:  # every rank redoes the step when one missed (DDP's redo is collective)
            torch.distributed.all_reduce(misses, op=torch.distributed.ReduceOp.MAX)
        missed = int(misses)  # the step's one host sync, before anything is applied
        if missed:
            self.graph = None
            self.redone_steps += 1
            self.headroom = min(2 * self.headroom, self._kt.MAX_HEADROOM)
            log.warning(
                "cuda_graph: %d TwELL call(s) of this step had more active entries than their captured "
                "capacity; the step is redone eagerly and the graph captured again at the next step, "
                "with capacities %.3g x the entry counts",
                missed,
                1 + self.headroom,
            )
            return None
        if self.world_size > 1:  # DDP's gradient average (divided first, as DDP does), one per buffer
            for flat in self._flats:
                flat.div_(self.world_size)
                torch.distributed.all_reduce(flat)
        if check_sizes:
            if self._oversized():
                self.graph = None  # this step stands; the next one captures at the current counts
                log.info(
                    "cuda_graph: TwELL capacities are more than twice what the current entry counts "
                    "take; capturing anew"
                )
            self.headroom = max(self._kt.DEFAULT_HEADROOM, self.headroom / 2)  # a clean step
        return results

    def _oversized(self) -> bool:
        if not self._sizes:
            return False
        entries = torch.cat([t for _, t in self._sizes]).tolist()
        with self._kt.capacity_headroom(self.headroom):  # against what a capture now would take
            return any(self._kt.oversized(cap, n) for (cap, _), n in zip(self._sizes, entries))

    def _static_grads(self) -> None:
        """Gradients for the graph to accumulate into, outside its memory pool. Under DDP, views into
        one zeroed flat buffer per dtype (one all-reduce each), made anew unless every gradient is
        already such a view; in one process, the existing tensors (zeros where there were none)."""
        params = [p for p in self.params if p.requires_grad]
        if self.world_size == 1:
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            return
        if self._flats and all(p.grad is g for p, g in zip(self.params, self._grads)):
            return  # still the views made last time
        self._flats = []
        for dtype in dict.fromkeys(p.dtype for p in params):
            group = [p for p in params if p.dtype == dtype]
            flat = torch.zeros(sum(p.numel() for p in group), dtype=dtype, device=self.device)
            offset = 0
            for p in group:
                p.grad = flat[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
            self._flats.append(flat)
        self._grads = [p.grad for p in self.params]

    def _capture(self, batch: tuple[torch.Tensor, torch.Tensor], l1_coef: float) -> None:
        kt = self._kt
        self.graph = None
        self._ids, self._labels = (t.clone() for t in batch)
        self._l1_coef = torch.full((), l1_coef, dtype=torch.float32, device=self.device)
        self._static_grads()
        side = self.stream or torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        sizes_mode = kt._settings["sizes"]
        try:
            with torch.cuda.stream(side), kt.capacity_headroom(self.headroom):
                for i in range(WARMUP_MICRO_BATCHES):
                    if i:
                        kt.set_sizes("static")
                    # only the loss is kept, and freed after its backward: an autograd graph kept
                    # alive (the logits hold one) would carry its gradient accumulators, made on this
                    # stream, into the capture
                    loss = self.loss_fn(self._ids, self._labels, self._l1_coef)[0]
                    (loss / self.grad_accum).backward()
                    del loss
            torch.cuda.current_stream(self.device).wait_stream(side)
            self.zero_grads()
            kt.static_misses(self.device).zero_()
            graph = torch.cuda.CUDAGraph()
            capture_stream = dict(stream=self.stream) if self.stream is not None else {}
            with kt.record_static_sizes() as recorded, torch.cuda.graph(graph, **capture_stream):
                loss, ce, out = self.loss_fn(self._ids, self._labels, self._l1_coef)
                (loss / self.grad_accum).backward()
        finally:
            kt.set_sizes(sizes_mode)
        self._sizes = recorded
        self._outputs = (ce.detach(), out.l1.detach(), out.stats)
        self._grads = [p.grad for p in self.params]
        self.graph = graph
        self.captures += 1
        log.info("cuda_graph: captured the micro-batch step (capture %d)", self.captures)


def _copy(value):
    return value.clone() if isinstance(value, torch.Tensor) else value
