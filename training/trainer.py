"""The training loop: one place to read what a step does.

step = grad_accum micro-batches (forward under autocast, CE in fp32 + l1_coef * L1, backward; DDP
all-reduces / FSDP2 reduce-scatters gradients only on the last micro-batch) -> clip to the global
norm -> AdamW -> dead-unit re-init -> metrics on the log cadence -> evaluations / checkpoint on
theirs. With train.cuda_graph the micro-batches are replayed from a CUDA graph (training/cuda_graph.py).

Data parallelism (train.parallel): ddp wraps the model in DistributedDataParallel when there is more
than one process (one process trains the plain model); fsdp shards it in place with FSDP2
(`fully_shard` per block, then the root; one process included), so parameters, gradients and AdamW
moments are DTensors, gathered in bf16 under bf16 precision (training/distributed.py).

Evaluations (validation loss / bits per byte, an lm-eval subset) are `Evaluator`s built by train.py
from eval/'s public API and handed in: this package never imports eval/.

Between log reads nothing waits for the GPU: losses and activity statistics accumulate in device
tensors and are read (one sync) every logging.log_interval steps.
"""

import contextlib
import functools
import inspect
import logging
import signal
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from twell.kernels._common import interpreting
from twell.model.ffn import kernels_usable
from twell.training.checkpoint import (
    CONFIG_NAME,
    Checkpointer,
    CheckpointError,
    capture_rng,
    config_yaml,
    restore_rng,
)
from twell.training.config import JobConfig
from twell.training.distributed import (
    DistInfo,
    all_reduce_,
    any_rank,
    barrier,
    set_gathered_between_micro_batches,
    shard_model,
)
from twell.training.loggers import RunLogger
from twell.training.memory import GIB, choose_activation_checkpointing, job_settings
from twell.training.metrics import mfu, peak_flops, peak_memory_gib
from twell.training.optim import build_optimizer, set_lr
from twell.training.profiling import StepProfiler, format_summary, phase
from twell.training.routing import choose_threshold
from twell.training.sparsity import ActivityTracker, l1_coef_at, reinit_dead_gate_rows

log = logging.getLogger(__name__)


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# A CPU step above this many FLOPs is worth a warning at start: ~15 minutes at 1e11 FLOP/s.
CPU_STEP_FLOPS_WARN = 1e14


class NothingToTrain(ValueError):
    """train.steps is below the step the run resumed from."""


def resolve_precision(precision: str, device: torch.device) -> str:
    if precision == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    return precision


def configure_compile() -> None:
    """torch.compile settings of the trainer's blocks: the TwELL training op's saved state has a
    data-dependent size (its entry count), which dynamo only keeps in the graph when it may capture
    operators with dynamic output shapes; without it every sparse block breaks its graph at the op and
    recompiles its pieces as layers switch (H200, paper_0.5b: 10 recompiles and a graph break per sparse
    block, against 1 recompile and none)."""
    torch._dynamo.config.capture_dynamic_output_shape_ops = True


def apply_block_wrappers(model: nn.Module, activation_checkpointing: bool, compile_blocks: bool) -> None:
    """Per-block activation checkpointing and torch.compile, applied from outside the model.

    Compiled blocks whose FFN may take the TwELL path are checkpointed selectively: the training op's
    outputs (its small sparse state) are kept and everything else is recomputed, so the backward pass
    does not run the FFN's forward again (kernels.training.train.checkpoint_context; torch >= 2.12.1,
    which compiles it: compiled_selective_checkpointing). Not eager blocks:
    there the policy runs as a dispatch mode that adds Python work to every operator of the block, in the
    forward and in the recomputation (a small block's forward and backward on a CPU: 5.8 ms with plain
    checkpointing, 12.1 ms with a policy that keeps nothing), more than the FFN's recomputation costs;
    compiled, the policy is applied once, when the block is traced. Both keep parameter names (and so
    checkpoints) unchanged: the checkpoint wrapper strips its prefix from state dicts and
    Module.compile() compiles in place."""
    for index, block in enumerate(model.layers):
        if activation_checkpointing:
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

            from twell.kernels.training.train import checkpoint_context, compiled_selective_checkpointing

            options = {}
            if block.ffn.impl != "dense" and compile_blocks and compiled_selective_checkpointing():
                options["context_fn"] = checkpoint_context
                _quiet_in_place_warning()
            block = checkpoint_wrapper(block, **options)
        if compile_blocks:
            configure_compile()
            block.compile()
        model.layers[index] = block


def _drop_in_place_warning(record: logging.LogRecord) -> bool:
    return "context_fn is passed to torch.utils.checkpoint" not in record.getMessage()


def _quiet_in_place_warning() -> None:
    """torch.compile warns, once per process, that a checkpoint with a policy must not hold in-place
    ops; a block's training forward holds none (tests/training/test_fast_path.py checks it), so the
    warning would only puzzle the run's log."""
    logger = logging.getLogger("torch._higher_order_ops.wrap")
    if _drop_in_place_warning not in logger.filters:
        logger.addFilter(_drop_in_place_warning)


def resolve_block_wrappers(
    job: JobConfig, device: torch.device, world_size: int, sharded: bool
) -> tuple[bool, bool]:
    """(activation checkpointing, torch.compile) for this run from train.activation_checkpointing and
    train.compile ("auto" | "true" | "false").

    compile auto: on a GPU, unless the step is replayed from a CUDA graph. Activation checkpointing
    auto: on a GPU, on when the step's memory estimate (training/memory.py) does not fit the device
    without it; never under a CUDA graph. An "auto" FFN starts dense, so it is estimated dense."""
    tcfg, mcfg = job.train, job.model
    on_gpu = device.type == "cuda"
    compile_blocks = tcfg.compiles(on_gpu)
    if tcfg.activation_checkpointing != "auto":
        return tcfg.activation_checkpointing == "true", compile_blocks
    if not on_gpu:
        return False, compile_blocks
    device_bytes = torch.cuda.get_device_properties(device).total_memory
    checkpoint, without, with_ac = choose_activation_checkpointing(
        mcfg, tcfg.micro_batch, tcfg.seq_len, device_bytes, **job_settings(job, world_size, sharded)
    )
    if checkpoint and tcfg.cuda_graph:
        log.warning("the step may not fit without activation checkpointing, which a CUDA graph cannot hold")
        checkpoint = False
    log.info(
        "memory estimate per GPU (%s blocks): %s without activation checkpointing, %s with; the device has "
        "%.1f GiB: activation checkpointing %s (train.activation_checkpointing=auto)",
        "compiled" if compile_blocks else "eager", without.describe(), with_ac.describe(), device_bytes / GIB,
        "on" if checkpoint else "off",
    )  # fmt: skip
    return checkpoint, compile_blocks


def check_cuda_graph_support(device: torch.device, world_size: int, parallel: str = "ddp") -> None:
    """train.cuda_graph=true needs what the capture supports (training/cuda_graph.py)."""
    if device.type != "cuda":
        raise ValueError(
            f"train.cuda_graph=true needs a CUDA device, but this run trains on {device.type}; "
            "set train.cuda_graph=false (or train.device=cuda on a GPU machine)"
        )
    if world_size > 1 and parallel != "ddp":
        raise ValueError(
            f"train.cuda_graph=true with {world_size} processes needs train.parallel=ddp, not "
            f"{parallel}: FSDP2's parameter gathers and gradient reduce-scatters are not captured; set "
            "train.parallel=ddp or train.cuda_graph=false"
        )


def _no_buffer_sync() -> dict:
    """DDP's argument for no per-forward buffer broadcast: forward_sync_buffers=False where PyTorch has
    it (it deprecates broadcast_buffers with a FutureWarning on every rank; the one broadcast at init
    it still does is harmless, the buffers being equal), broadcast_buffers=False before."""
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


def micro_loss(model: nn.Module, autocast, input_ids: torch.Tensor, labels: torch.Tensor, l1_coef):
    """(CE + l1_coef * L1, CE, model output) of one micro-batch: the forward under `autocast`, CE in
    fp32 over the logits whatever the autocast dtype."""
    with autocast:
        out = model(input_ids)
    ce = F.cross_entropy(out.logits.float().flatten(0, 1), labels.flatten())
    return ce + l1_coef * out.l1, ce, out


def clip_grad_norm(parameters: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clip to the global gradient norm (over every rank's shard under FSDP2); returns that norm as
    a plain tensor. With DTensor gradients clip_grad_norm_ reduces the per-shard norms over the
    ranks itself and returns a replicated DTensor; full_tensor() makes it a plain tensor."""
    norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm, foreach=True)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


@dataclass
class Evaluator:
    """A periodic evaluation of the model: fn(model) -> {metric name: float}.

    Runs after every `interval`-th optimizer step (0 = never) under torch.no_grad with the model in
    eval mode (train mode is restored). all_ranks: every rank calls fn (it may hold collectives,
    e.g. an all-reduce of validation sums) with the trainer's model: the plain one under DDP (never
    the DDP wrapper), the sharded one under FSDP2, whose forward gathers parameters, so every rank
    must run the same forwards. Otherwise rank 0 alone calls it and the other ranks wait at a
    barrier afterwards, so fn must not hold collectives (if it raises, the error is logged and
    training goes on rather than leave the others waiting); under FSDP2 it gets a full unsharded
    replica that all ranks gathered to rank 0 just before. The metrics of all evaluators due at a
    step go into one record {"step": step, **metrics} (rank 0's metrics where only rank 0 ran).
    """

    name: str
    interval: int
    fn: Callable[[nn.Module], dict]
    all_ranks: bool = True


class Trainer:
    def __init__(
        self,
        job: JobConfig,
        model: nn.Module,
        train_stream: Iterator[dict],
        info: DistInfo,
        evaluators: Sequence[Evaluator] = (),
    ):
        self.job, self.info, self.device = job, info, info.device
        self.train_stream, self.evaluators = train_stream, list(evaluators)
        self._data_wait_s = 0.0  # reset per logging window (_reset_window)
        tcfg = job.train
        if tcfg.cuda_graph:  # before anything is built: the set-ups a capture cannot hold are refused
            check_cuda_graph_support(self.device, info.world_size, tcfg.parallel)
        if job.sparsity.reinit_kernel == "true" and self.device.type != "cuda" and not interpreting():
            raise ValueError(
                f"sparsity.reinit_kernel=true runs a Triton kernel, which needs a CUDA device (this run trains "
                f"on {self.device.type}); set sparsity.reinit_kernel=auto (PyTorch's draw off a GPU) or false"
            )
        self.grad_accum = tcfg.grad_accum(info.world_size)
        self.precision = resolve_precision(tcfg.precision, self.device)
        self.total_steps = tcfg.steps
        self.run_dir = Path(job.run_dir)

        # The model itself (sharded in place under fsdp, never a DDP wrapper): checkpoints, re-init,
        # routing, evaluation.
        self.model = model.to(self.device)
        self._model_cls = type(model)  # before fully_shard changes it: builds the lm-eval replica
        # The FFNs are collected before wrapping, which may hide the blocks behind a wrapper; their
        # gate weights are read at each re-init, since fully_shard replaces the parameters.
        self.ffns = [block.ffn for block in self.model.layers]
        self.sharded = tcfg.parallel == "fsdp"  # FSDP2 over every process, one included
        self.checkpoint_blocks, self.compile_blocks = resolve_block_wrappers(
            job, self.device, info.world_size, self.sharded
        )
        apply_block_wrappers(self.model, self.checkpoint_blocks, self.compile_blocks)
        self.forward_model = self.model
        self._graph_stream = None  # DDP under CUDA graphs: the stream DDP is built and captured on
        self._held_gathered: list[nn.Module] = []  # FSDP2 modules kept gathered between micro-batches
        if self.sharded:
            self._held_gathered = shard_model(  # wrappers first, then fully_shard (as torchtitan)
                self.model, self.device, bf16=self.precision == "bf16",
                reshard_after_forward=tcfg.fsdp_reshard_after_forward, prefetch=tcfg.fsdp_prefetch,
            )  # fmt: skip
        elif info.enabled:
            if tcfg.cuda_graph:
                # DDP keeps each parameter's gradient accumulator alive, bound to the stream it is
                # built on: a capture on any other stream fails. Built, captured and redone on one.
                self._graph_stream = torch.cuda.Stream(self.device)
                self._graph_stream.wait_stream(torch.cuda.current_stream(self.device))
            with self._on_graph_stream():
                self.forward_model = DistributedDataParallel(
                    self.model,
                    device_ids=[self.device.index] if self.device.type == "cuda" else None,
                    # The gradients are views into the all-reduce buckets: one fp32 copy of them, not two
                    # (6 GB less at 1.5b), and no copy into and out of the buckets each step. Not under
                    # CUDA graphs: the graph keeps its own static gradients, which a redo through DDP
                    # would rebind.
                    gradient_as_bucket_view=not tcfg.cuda_graph,
                    # Buffers (RoPE tables, routing flags) are identical on every rank by construction:
                    # broadcasting them every forward would be a wasted collective.
                    **_no_buffer_sync(),
                )
        self.optimizer = build_optimizer(self.model, job.optim, self.device)
        mcfg = job.model
        self.tracker = ActivityTracker(mcfg.n_layers, mcfg.d_ff, self.device, job.sparsity.dead_window_tokens)
        self.run_config = asdict(job)
        self.checkpointer = Checkpointer(job.checkpoint_dir, job.checkpoint.keep_last, info, self.run_config)
        self.step = self.start_step = 0
        self.stop_requested = False
        self.stop_signal = "SIGTERM"  # the name said when stopping; another rank's signal stops this one too
        self.flops_per_token = mcfg.flops_per_token(tcfg.seq_len)
        self.peak_flops = peak_flops(self.device, self.precision, tcfg.peak_flops)
        # Autocast's weight-cast cache is off under CUDA graphs (PyTorch's advice for capture).
        self.autocast = (
            torch.autocast(self.device.type, dtype=torch.bfloat16, cache_enabled=not tcfg.cuda_graph)
            if self.precision == "bf16"
            else contextlib.nullcontext()
        )
        self.graphed = None
        # TwELL entry lists sized deferred (see _micro_steps) wherever the sparse path may run outside a
        # CUDA graph; twell_redos: steps redone because a layer's entries outgrew their capacity.
        # Whether sparse FFN layers run on the TwELL kernels: on CUDA, or the CPU under Triton's interpreter
        # (the tests); elsewhere they train on the dense reference (model.ffn.kernels_usable, per call).
        self.sparse_kernels = mcfg.ffn_impl != "dense" and kernels_usable(torch.empty(0, device=self.device))
        self._kt = None
        self._entry_misses = None  # the op's eager calls whose entries outgrew their capacity, for the logs
        if self.sparse_kernels:
            import twell.kernels.training.train as kt

            # estimate and late are the op's process-wide setting; deferred is set around each step
            kt.set_sizes("late" if tcfg.twell_sizes == "late" else "estimate")
            if tcfg.twell_sizes == "deferred" and not tcfg.cuda_graph:
                self._kt = kt
            self._entry_misses = kt.entry_misses
        # The TwELL op's per-layer CUDA graphs (train.twell_graphs), and their counters for the logs
        self._graph_stats = None
        if self.sparse_kernels and self.device.type == "cuda":
            from twell.kernels.training.train_graph import graph_stats, set_graphs

            set_graphs(tcfg.twell_graphs)
            self._graph_stats = graph_stats
        self.twell_redos = 0
        self.warm_up_seconds: float | None = None  # the sparse path's warm-up before training (auto FFN, GPU)
        self.twell_threshold: float | None = None  # auto FFN: layers switch below it (set by fit)
        if tcfg.cuda_graph:
            from twell.training.cuda_graph import GraphedMicroStep

            params = [p for p in self.model.parameters() if p.requires_grad]
            # The plain model, never the DDP wrapper: the graph holds no collective (the gradients are
            # all-reduced after the replays; DDP's own hooks stay idle outside its forward).
            graph_loss = functools.partial(self._micro_loss, model=self.model)
            self.graphed = GraphedMicroStep(
                params, graph_loss, self.grad_accum, self.device, info.world_size, self._graph_stream
            )
        self._reset_window()

    # ------------------------------------------------------------------ state
    def _trainer_state(self) -> dict:
        """Replicated state saved through DCP (identical on every rank)."""
        return {"step": self.step, "tracker": self.tracker.state_dict()}

    def _rank_state(self) -> dict:
        """Per-rank state: where this rank's data stream is, and its RNGs."""
        return {"data": self.train_stream.state_dict(), "rng": capture_rng(self.device)}

    def save_checkpoint(self) -> Path:
        path = self.checkpointer.save(
            self.step, self.model, self.optimizer, self._trainer_state(), self._rank_state()
        )
        self._say(f"saved checkpoint {path}")
        self.record_config()
        return path

    def record_config(self) -> None:
        """<run_dir>/config.yaml: the config of the launch that wrote the newest checkpoint (rank 0).
        Written only once this launch has saved one, so a launch that crashes or trains nothing
        leaves the record of the checkpoints on disk as it was. Every checkpoint holds its own copy."""
        if not self.info.is_main:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.run_dir / (CONFIG_NAME + ".tmp")
        tmp.write_text(config_yaml(self.run_config))
        tmp.replace(self.run_dir / CONFIG_NAME)

    def resume(self) -> int:
        """Load the checkpoint named by checkpoint.resume; returns the step to continue from."""
        resume = self.job.checkpoint.resume
        if resume == "none":
            return 0
        template = self._trainer_state()
        if resume == "auto":
            found = self.checkpointer.load_latest(self.model, self.optimizer, template)
            if found is None:
                return 0
            path, trainer_state, rank_state = found
        else:
            path = Path(resume)
            if not path.is_dir():
                raise CheckpointError(
                    f"checkpoint.resume={resume} is not a folder; give a step_XXXXXXXX checkpoint folder, "
                    f"or use checkpoint.resume=auto (latest in {self.checkpointer.dir}) or none"
                )
            trainer_state, rank_state = self.checkpointer.load(path, self.model, self.optimizer, template)
        self.step = int(trainer_state["step"])
        self.tracker.load_state_dict(trainer_state["tracker"])
        self.train_stream.load_state_dict(rank_state["data"])
        restore_rng(rank_state["rng"], self.device)
        self._say(f"resumed from {path} at step {self.step}")
        return self.step

    # ------------------------------------------------------------------ loop
    def fit(self) -> list[dict]:
        """Train to train.steps (or until SIGTERM / a first SIGINT); returns the logged records (rank 0).

        Raises NothingToTrain when train.steps is below the resumed step; at train.steps exactly the
        run is complete: it says so and returns no records."""
        start_step = self.start_step = self.resume()
        if start_step >= self.total_steps:
            extend = (
                f"to extend the run, set train.steps to more than {start_step} (e.g. "
                f"train.steps={2 * start_step}; the LR schedule spans train.steps); to train anew, give "
                "it a new run_name/run_dir or checkpoint.resume=none"
            )
            if start_step > self.total_steps:
                raise NothingToTrain(
                    f"nothing to train: train.steps={self.total_steps} is below step {start_step}, "
                    f"where this run resumed from {self.checkpointer.dir}; {extend}"
                )
            self._say(f"nothing to train: the run is complete at train.steps={self.total_steps}; {extend}")
            return []
        self.logger = RunLogger(
            self.job.logging,
            self.run_dir,
            self.job.run_name,
            asdict(self.job),
            self.info.is_main,
            self.total_steps,
            start_step,
        )
        self._say(
            f"training {self.model.num_params() / 1e6:.2f}M parameters on {self.info.world_size} x "
            f"{self.device.type} ({self.precision}, {self._parallel_name()}), grad_accum {self.grad_accum}, "
            f"{self.job.train.global_batch_tokens} tokens/step, steps {start_step}..{self.total_steps}"
        )
        step_flops = self.flops_per_token * self.job.train.global_batch_tokens
        if self.device.type == "cpu" and step_flops > CPU_STEP_FLOPS_WARN and self.info.is_main:
            log.warning(
                "this CPU run does %.3g FLOPs a step (6 N + 6 L d S per token x %d tokens): hours a step at the "
                "~1e11 FLOP/s of a CPU; the README's CPU run is experiment=quickstart (or a smaller model and "
                "train.global_batch_tokens)",
                step_flops,
                self.job.train.global_batch_tokens,
            )
        on_off = {True: "on", False: "off"}
        graphs = f"CUDA graphs {on_off[self.graphed is not None]}"
        if self._graph_stats is not None:  # sparse FFNs on a GPU: the TwELL op's own graphs may run
            graphs += f", TwELL op graphs {on_off[self.job.train.twell_graphs]}"
        elif self.job.train.twell_graphs and self.info.is_main:
            log.warning(
                "train.twell_graphs=true has no effect in this run (model.ffn_impl=%s on %s): the TwELL op's "
                "graphs replay sparse FFN layers (model.ffn_impl=auto or twell) on a GPU",
                self.job.model.ffn_impl,
                self.device.type,
            )
        ffn = self.job.model.ffn_impl
        if ffn != "dense" and not self.sparse_kernels:
            ffn += " (the dense reference's math here: the TwELL kernels run on a GPU, or under TRITON_INTERPRET=1)"
        elif ffn != "dense":
            ffn += f" (TwELL entry lists sized {self.job.train.twell_sizes})"
        self._say(
            f"FFN {ffn}, torch.compile {on_off[self.compile_blocks]}, activation "
            f"checkpointing {on_off[self.checkpoint_blocks]}, {graphs}"
        )
        self._warm_sparse_path()
        if self.job.model.ffn_impl == "auto":  # measured after the warm-up, which tunes the kernels it times
            tokens = self.job.train.micro_batch * self.job.train.seq_len
            choice = choose_threshold(
                self.job.model, tokens, self.device, precision=self.precision, compiled=self.compile_blocks
            )
            self.twell_threshold = choice.threshold
            self._say(choice.describe())
            self.logger.log_run_info({"step": start_step, **choice.record()})
        # SIGTERM (a scheduler's preemption) and a first SIGINT (Ctrl-C) stop after the current step
        # with a checkpoint; a second SIGINT quits at once (KeyboardInterrupt).
        previous_handlers = {sig: signal.signal(sig, self._on_stop_signal) for sig in STOP_SIGNALS}
        records = []
        last_saved = start_step if start_step > 0 else None
        lcfg = self.job.logging
        profiler = StepProfiler(
            lcfg.profile_at,
            lcfg.profile_steps,
            self.run_dir / "profile",
            self.device,
            prefix="" if self.info.is_main else f"rank{self.info.rank}_",
        )
        try:
            self.model.train()
            self._reset_window()
            while self.step < self.total_steps:
                profiler.before_step(self.step)
                self.train_step()
                profile = profiler.after_step(self.step)
                if profile is not None:
                    self._window_t0 += profiler.overhead_s  # the profiler's own work is not training time
                    records.append(self._log_profile(profile, profiler.out_dir))
                if self.step % self.job.logging.log_interval == 0 or self.step == self.total_steps:
                    records.append(self._log_window())
                due = [e for e in self.evaluators if e.interval and self.step % e.interval == 0]
                if due:
                    records.append(self._evaluate(due))
                interval = self.job.checkpoint.interval
                if interval and self.step % interval == 0:
                    self.save_checkpoint()
                    last_saved = self.step
                    self._window_t0 = time.perf_counter()  # saving is not training time
                if any_rank(self.stop_requested):
                    self._say(f"{self.stop_signal}: stopping at step {self.step}")
                    break
            if last_saved != self.step and (self.job.checkpoint.save_final or self.stop_requested):
                self.save_checkpoint()
            profile = profiler.close(self.step)  # a run that ended inside the profiled steps
            if profile is not None:
                records.append(self._log_profile(profile, profiler.out_dir))
        finally:
            for sig, handler in previous_handlers.items():
                signal.signal(sig, handler)
            self.logger.close()
        return records

    def _warm_sparse_path(self) -> None:
        """model.ffn_impl=auto on a GPU: before the first step, the sparse path is run once so that its
        first use, when layers switch, costs nothing visible: the TwELL kernels are compiled and autotuned
        on paper-like activity at this run's tokens per micro-batch (kernels.training.train.warm_up), then one
        micro-batch of random tokens goes forward and backward with every FFN sparse, which compiles the
        blocks' sparse variant under train.compile. No gradient is synchronised or kept, no optimizer or
        data state moves, and the global RNG is untouched: the run is the same as without it."""
        mcfg, tcfg = self.job.model, self.job.train
        routing = [ffn._sparse_now for ffn in self.ffns]
        if (
            not tcfg.warm_up
            or mcfg.ffn_impl != "auto"
            or self.device.type != "cuda"
            or self.graphed is not None
        ):
            return
        if all(routing):  # resumed with every layer sparse already: no switch ahead
            return
        from twell.kernels.training.train import forget_sizes, warm_up

        tokens = tcfg.micro_batch * tcfg.seq_len
        kernel_s = warm_up(tokens, mcfg.d_model, mcfg.d_ff, self.device, hot_units=mcfg.twell_hot_units)
        if self.sharded:  # FSDP2 keeps unsynchronised gradients in buffers of its own: no model pass
            self.warm_up_seconds = kernel_s
            self._say(f"warmed the TwELL kernels before training in {kernel_s:.1f} s")
            return
        start = time.perf_counter()
        gen = torch.Generator(device=self.device).manual_seed(tcfg.seed)
        ids = torch.randint(
            mcfg.vocab_size, (tcfg.micro_batch, tcfg.seq_len + 1), generator=gen, device=self.device
        )
        for ffn in self.ffns:
            ffn.set_sparse(True)
        try:
            with self._on_graph_stream(), self._grad_sync(False):
                loss, _, _ = self._micro_loss(
                    ids[:, :-1], ids[:, 1:], l1_coef_at(self.step, self.job.sparsity)
                )
                loss.backward()
        finally:
            for ffn, flag in zip(self.ffns, routing):
                ffn.set_sparse(flag)
            self.optimizer.zero_grad(set_to_none=True)
        # A random model's half-active gate would size the layers' first sparse steps: forget it.
        forget_sizes([ffn.w_gate for ffn in self.ffns])
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # a random model's half-active gate made the sparse state large
        torch.cuda.reset_peak_memory_stats(self.device)
        model_s = time.perf_counter() - start
        self.warm_up_seconds = kernel_s + model_s
        self._say(
            f"warmed the sparse FFN path before training: kernels {kernel_s:.1f} s, model {model_s:.1f} s"
        )

    def _micro_loss(
        self, input_ids: torch.Tensor, labels: torch.Tensor, l1_coef, model: nn.Module | None = None
    ):
        """One micro-batch's forward and loss: (loss, ce, model output). CE in fp32 over the logits
        whatever the autocast dtype; l1_coef a float, or a device scalar under CUDA graphs. `model`:
        the module to run (default: forward_model, the DDP wrapper under DDP)."""
        return micro_loss(model or self.forward_model, self.autocast, input_ids, labels, l1_coef)

    def _add_micro(self, ce: torch.Tensor, l1: torch.Tensor, stats) -> None:
        self._ce_sum += ce
        self._l1_sum += l1
        self.tracker.add(stats)

    def train_step(self) -> None:
        """One optimizer step over grad_accum micro-batches of this rank."""
        lr = set_lr(self.optimizer, self.job.optim, self.step, self.total_steps)
        l1_coef = l1_coef_at(self.step, self.job.sparsity)
        replayed = None
        if self.graphed is not None:
            # The step's micro-batches up front: an eager redo after a capacity miss needs them again.
            batches = [self._next_batch() for _ in range(self.grad_accum)]
            routing = tuple(ffn._sparse_now for ffn in self.ffns)
            check = (self.step + 1) % self.job.model.twell_check_interval == 0
            replayed = self.graphed.run_step(batches, l1_coef, routing, check_sizes=check)
            if replayed is None:  # a TwELL layer's entries did not fit: nothing of the replays is kept
                self.graphed.zero_grads()
        else:
            # One at a time, as they are needed: the host's data work overlaps the GPU's.
            batches = (self._next_batch() for _ in range(self.grad_accum))
        if replayed is None:
            replayed = self._micro_steps(batches, l1_coef)
        for ce, l1, stats in replayed:
            self._add_micro(ce, l1, stats)
        with phase("optimizer"):
            # max_norm=inf measures without clipping when clipping is off.
            clip = self.job.train.grad_clip or float("inf")
            grad_norm = clip_grad_norm(list(self.model.parameters()), clip)
            self.optimizer.step()
            # Under CUDA graphs the gradients are the graph's static tensors: zeroed in place, kept.
            self.optimizer.zero_grad(set_to_none=self.graphed is None)
        self.step += 1
        with phase("sparsity"):
            self._end_step_sparsity()
        self._grad_norm_sum += grad_norm.detach()
        self._window_steps += 1
        self._lr, self._l1_coef = lr, l1_coef

    def _end_step_sparsity(self) -> None:
        """After the optimizer step: the activity window, dead units' re-initialisation, FFN routing."""
        self.tracker.end_step(self.info.world_size)
        scfg = self.job.sparsity
        if scfg.reinit_dead and self.step % scfg.reinit_period == 0:
            self.tracker.reinit_units += reinit_dead_gate_rows(
                [ffn.w_gate for ffn in self.ffns],
                self.tracker.reinit_due(),
                self.step,
                self.job.train.seed,
                scfg.reinit_lambda,
                scfg.reinit_sigma,
                self.optimizer if scfg.reset_optimizer_moments else None,
                kernel=scfg.reinit_by_kernel(self.device.type == "cuda"),
            )
        if self.job.model.ffn_impl == "auto" and self.step % self.job.model.twell_check_interval == 0:
            self.model.update_ffn_routing(self.tracker.route_mean(), self.twell_threshold)

    def _micro_steps(self, batches, l1_coef) -> list:
        """Forward and backward of the step's micro-batches (gradients accumulate in .grad); returns
        (ce, l1, stats) of each. With sparse FFNs and train.twell_sizes=deferred, no TwELL layer waits
        for the GPU: their entry counts are checked once, after the last backward (one host sync, reduced
        over ranks), and a step in which a layer's entries outgrew its capacity is redone before anything
        is applied (`twell_redos` counts them): at the capacities that settle sized from this very step's
        counts (so the redo keeps the deferred margin for the steps after it), then, should that miss
        too, with every call sized exactly."""
        if self._kt is None:
            return self._run_micro_batches(batches, l1_coef)
        kept = []  # the micro-batches as they are drawn: a redo needs them again
        reduce = (lambda flag: all_reduce_(flag, op=dist.ReduceOp.MAX)) if self.info.enabled else None
        with self._kt.deferred_sizes() as sizes:
            results = self._run_micro_batches((kept.append(b) or b for b in batches), l1_coef)
            if not self._settle(sizes, reduce):
                return results
            self.twell_redos += 1
            self.optimizer.zero_grad(set_to_none=True)
            results = self._run_micro_batches(kept, l1_coef)
            if not self._settle(sizes, reduce):
                return results
        # Missed again (counts that differ between two passes over the same batches): sized exactly.
        self.optimizer.zero_grad(set_to_none=True)
        return self._run_micro_batches(kept, l1_coef)

    def _settle(self, sizes, reduce) -> bool:
        """The deferred entry counts' check (the step's one host sync): whether a layer missed."""
        with phase("settle"):
            return sizes.settle(reduce=reduce, device=self.device)

    def _run_micro_batches(self, batches, l1_coef) -> list:
        results = []
        with self._on_graph_stream():
            for micro, (input_ids, labels) in enumerate(batches):
                with self._grad_sync(micro == self.grad_accum - 1):
                    with phase("forward"):
                        loss, ce, out = self._micro_loss(input_ids, labels, l1_coef)
                    with phase("backward"):
                        (loss / self.grad_accum).backward()
                results.append((ce.detach(), out.l1.detach(), out.stats))
        return results

    @contextlib.contextmanager
    def _on_graph_stream(self):
        """Run the block on DDP's stream under CUDA graphs (see __init__), ordered after and before the
        current stream's work; a no-op otherwise."""
        stream = self._graph_stream
        if stream is None:
            yield
            return
        current = torch.cuda.current_stream(self.device)
        stream.wait_stream(current)
        try:
            with torch.cuda.stream(stream):
                yield
        finally:
            current.wait_stream(stream)

    def _grad_sync(self, last: bool):
        """Gradients are reduced over ranks only after the last micro-batch of a step; before it they
        accumulate locally (DDP: no_sync; FSDP2: unsharded gradients, no reduce-scatter)."""
        if self.sharded:
            self.model.set_requires_gradient_sync(last)
            set_gathered_between_micro_batches(self._held_gathered, last)
            return contextlib.nullcontext()
        if last or not self.info.enabled:
            return contextlib.nullcontext()
        return self.forward_model.no_sync()

    def _parallel_name(self) -> str:
        if self.sharded:
            return "FSDP2"
        return "DDP" if self.info.enabled else "one process"

    def _next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        with phase("data"):
            waited = time.perf_counter()
            batch = next(self.train_stream)
            self._data_wait_s += time.perf_counter() - waited
            input_ids, labels = batch["input_ids"], batch["labels"]
            if self.device.type == "cuda":
                # Pinned host memory makes the copy asynchronous: the CPU moves on to queue the step.
                input_ids, labels = input_ids.pin_memory(), labels.pin_memory()
            return input_ids.to(self.device, non_blocking=True), labels.to(self.device, non_blocking=True)

    # ------------------------------------------------------------------ metrics
    def _reset_window(self) -> None:
        zero = lambda: torch.zeros((), dtype=torch.float32, device=self.device)
        self._ce_sum, self._l1_sum, self._grad_norm_sum = zero(), zero(), zero()
        self._window_steps = 0
        self._data_wait_s = 0.0  # host seconds this rank waited for micro-batches in the window
        self._window_t0 = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def _log_window(self) -> dict:
        """Reduce the window's device sums over ranks and read them: the loop's only host sync."""
        steps, micro = self._window_steps, self._window_steps * self.grad_accum
        wait = torch.tensor(self._data_wait_s, dtype=torch.float32, device=self.device)
        sums = torch.stack([self._ce_sum / micro, self._l1_sum / micro, self._grad_norm_sum / steps, wait])
        sums = all_reduce_(sums) / self.info.world_size
        ce, l1, grad_norm, data_wait_s = sums.tolist()
        activity = self.tracker.read()
        elapsed = time.perf_counter() - self._window_t0
        tokens_per_s = steps * self.job.train.global_batch_tokens / elapsed
        record = {
            "step": self.step,
            "tokens": self.step * self.job.train.global_batch_tokens,
            "loss": ce + self._l1_coef * l1,
            "ce": ce,
            "l1": l1,
            "l1_coef": self._l1_coef,
            "lr": self._lr,
            "grad_norm": grad_norm,
            "tokens_per_s": tokens_per_s,
            "data_wait_s": data_wait_s,  # mean over ranks of the window's seconds spent waiting for data
            "mfu": mfu(self.flops_per_token, tokens_per_s, self.peak_flops, self.info.world_size),
            "peak_mem_gib": peak_memory_gib(self.device),
            **activity,
        }
        if self._kt is not None:  # steps redone because a layer's entries outgrew their capacity, so far
            record["twell_redos"] = self.twell_redos
        # the TwELL op's forwards redone (sizes estimate) and entry lists rebuilt (late), so far
        if self._entry_misses is not None:
            record.update({f"twell_misses_{k}": v for k, v in self._entry_misses().items()})
        if self._graph_stats is not None:  # TwELL passes replayed from per-layer CUDA graphs, and not, so far
            record.update({f"twell_graph_{k}": v for k, v in self._graph_stats().items()})
        if self.job.model.ffn_impl == "auto":  # the routing per layer, as the next steps will run it
            record["ffn_sparse"] = [int(ffn._sparse_now) for ffn in self.ffns]
        self.logger.log(record)
        self._reset_window()
        return record

    def _log_profile(self, summary: dict, out_dir: Path) -> dict:
        """The profiled steps' summary on the console and as one record (flat keys, profile/*: one wandb
        panel group)."""
        self._say(f"profile of steps {self.step - summary['steps'] + 1}-{self.step} ({out_dir}):")
        self._say(format_summary(summary))
        record = {"step": self.step, "kind": "profile"}
        for key, value in summary.items():
            if key == "gpu_ms_by_kind":
                record.update({f"profile/gpu_ms/{kind}": ms for kind, ms in value.items()})
            elif key == "gpu_idle_ms_by_phase":
                record.update({f"profile/gpu_idle_ms/{name}": ms for name, ms in value.items()})
            else:
                record[f"profile/{key}"] = value
        self.logger.log(record)
        return record

    def _evaluate(self, evaluators: list[Evaluator]) -> dict:
        """Run the evaluators due at this step on the model (never the DDP wrapper: no gradient-sync
        hooks; under FSDP2 a rank-0-only evaluator gets a gathered replica, since the sharded
        model's forward is a collective); one record for all."""
        record = {"step": self.step}
        for evaluator in evaluators:
            model = self.model
            if self.sharded and not evaluator.all_ranks:
                model = self._gather_replica()  # every rank takes part; None except on rank 0
            if evaluator.all_ranks or self.info.is_main:
                was_training = model.training
                model.eval()
                try:
                    with torch.no_grad():
                        record.update(evaluator.fn(model))
                except Exception:
                    if evaluator.all_ranks:
                        raise  # every rank fails alike: nobody is left waiting
                    # Raising here would leave the other ranks at the barrier forever.
                    log.exception(
                        "evaluation %r failed at step %d; training goes on", evaluator.name, self.step
                    )
                finally:
                    model.train(was_training)
            del model  # the replica, if any: free it before training goes on
            if not evaluator.all_ranks:
                barrier()  # the other ranks wait here while rank 0 evaluates
        self.logger.log(record)
        self._window_t0 = time.perf_counter()  # evaluation is not training time
        return record

    def _gather_replica(self) -> nn.Module | None:
        """FSDP2: a plain, unsharded copy of the model on rank 0 (None elsewhere), for evaluations
        that rank 0 runs alone (lm-eval). Collective: all-gathers the full state dict (to rank 0's
        CPU memory) on every rank, then rank 0 builds the model on its device and loads it."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(self.model, options=options)
        if not self.info.is_main:
            return None
        with torch.device("meta"):
            replica = self._model_cls(self.job.model)
        replica.to_empty(device=self.device)
        # init_weights() fills the RoPE tables (not in the state dict); the weights it draws are
        # overwritten just below, and the global RNGs are left as training had them.
        cuda = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda, device_type=self.device.type):
            replica.init_weights()
        replica.load_state_dict(state)
        return replica.train(self.model.training)

    # ------------------------------------------------------------------ misc
    def _on_stop_signal(self, signum, frame) -> None:
        # Only a flag: the loop saves at the end of the current step, on every rank together.
        if signum == signal.SIGINT and self.stop_requested:
            raise KeyboardInterrupt  # a second Ctrl-C: quit now, without saving
        self.stop_requested = True
        self.stop_signal = signal.Signals(signum).name
        if signum == signal.SIGINT and self.info.is_main:
            print(
                "\nSIGINT: saving a checkpoint after this step, then stopping (Ctrl-C again quits at once, "
                "without saving)",
                file=sys.stderr,
                flush=True,
            )

    def _say(self, message: str) -> None:
        if self.info.is_main:
            logger = getattr(self, "logger", None)
            if logger is not None:
                logger.info(message)
            else:
                print(message, flush=True)
