"""Root Hydra schema: every value of a training run has a type and is checked at start-up.

configs/train.yaml selects one YAML per group (model, data, optim, train, sparsity, logging,
checkpoint, eval); Hydra merges them into `JobConfig`, whose fields are typed, so a wrong type fails
at composition. `OmegaConf.to_object` then builds the dataclasses, which runs each `__post_init__`:
the checks that need values (ranges, choices, divisibility) live there and name the bad value and
the fix.
"""

import dataclasses
from dataclasses import dataclass, field

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from twell.data import DataConfig
from twell.model import ModelConfig
from twell.training.schedule import SCHEDULES

PARALLEL_MODES = ("ddp", "fsdp")


def _choice(name: str, value: str, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not one of {choices}; set {name}=<one of them>")


def _auto_bool(name: str, value) -> str:
    """ "auto" | "true" | "false" from a bool or a string of any case (YAML and the command line give
    bools for true/false; a str field stores them as "True"/"False")."""
    text = str(value).lower()
    if text not in ("auto", "true", "false"):
        raise ValueError(f"{name}={value!r} must be auto, true or false")
    return text


def _positive(name: str, value, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name}={value} must be {bound}")


@dataclass
class OptimConfig:
    """AdamW and the LR schedule. Defaults are the paper's recipe (PAPER.md)."""

    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    # The paper only says "weight decay 0.1". We decay every matrix (embeddings included: they are
    # tied to the output layer) and leave the 1-D RMSNorm gains undecayed, as in nanoGPT/LLaMA.
    decay_norm_gains: bool = False
    schedule: str = "cosine"  # cosine | wsd | constant
    warmup_steps: int = 600
    min_lr_ratio: float = 0.0  # final LR as a fraction of the peak
    decay_fraction: float = 0.2  # wsd only: the last fraction of steps that decays

    def __post_init__(self):
        _choice("optim.schedule", self.schedule, SCHEDULES)
        _positive("optim.lr", self.lr)
        _positive("optim.eps", self.eps)
        _positive("optim.weight_decay", self.weight_decay, allow_zero=True)
        _positive("optim.warmup_steps", self.warmup_steps, allow_zero=True)
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"optim.{name}={getattr(self, name)} must be in [0, 1)")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"optim.min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")
        if not 0.0 < self.decay_fraction <= 1.0:
            raise ValueError(f"optim.decay_fraction={self.decay_fraction} must be in (0, 1]")


@dataclass
class TrainConfig:
    """Batch geometry, length, precision, data parallelism and the per-block wrappers."""

    global_batch_tokens: int = 1_048_576  # tokens per optimizer step, all ranks together
    micro_batch: int = 8  # sequences per forward on one rank
    seq_len: int = 2048
    steps: int = 30_000  # optimizer steps of the whole run
    grad_clip: float = 1.0  # max global grad norm; 0 turns clipping off
    precision: str = "auto"  # auto (bf16 autocast on GPU, fp32 on CPU) | bf16 | fp32
    # torch.compile each transformer block: auto (on a GPU, unless train.cuda_graph) | true | false
    compile: str = "auto"
    # Replay each micro-batch's forward + backward from one CUDA graph (a GPU; one process or DDP; see
    # training/cuda_graph.py): no per-kernel host cost, which bounds an eager TwELL step.
    cuda_graph: bool = False
    # Recompute each block in the backward pass: auto (on a GPU when the step's memory estimate,
    # training/memory.py, does not fit without it) | true | false
    activation_checkpointing: str = "auto"
    # model.ffn_impl=auto on a GPU: compile and autotune the sparse FFN path before step 1, so the switch
    # of layers to it costs nothing mid-run (Trainer._warm_sparse_path)
    warm_up: bool = True
    # How the TwELL training op sizes each layer's entry list (kernels/training/train.py, SIZES): estimate (each
    # sparse layer reads its count back after issuing its forward: one host sync a layer) | late (no
    # forward waits: the outputs are exact whatever the count, and the backward checks it, rebuilding a
    # layer's entries that did not fit) | deferred (no layer waits; the step's counts are checked once
    # before the optimizer step, a step that missed is redone). One H200, paper_0.5b, 16k-token steps:
    # estimate 171k tokens/s, deferred 136k, dense 144k (docs/results/twell_sizes/).
    twell_sizes: str = "estimate"
    # TwELL's forward and backward replayed from CUDA graphs per layer (kernels/training/train_graph.py), in
    # eager and compiled steps: the op's host cost falls from ~1.5 ms a layer to a few graph launches.
    # Opt-in: the compiled races on an H100 ran slower with them, 1.5b by 5.5% (docs/results/2026-12-07-c/).
    twell_graphs: bool = False
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda
    peak_flops: float = 0.0  # per-device peak FLOP/s for MFU; 0 = look up by GPU name
    # With more than one process: ddp (replicated parameters, all-reduced gradients) | fsdp (FSDP2:
    # parameters, gradients and AdamW moments sharded over the ranks). One process trains the
    # plain model either way.
    parallel: str = "ddp"
    # fsdp only. Free each block's gathered parameters after its forward (gather again for the backward):
    # auto (every block but the last, which the backward needs first; none on one rank, where nothing is
    # sharded) | true (every block: least memory) | false (none: one gather per micro-batch, a replica's
    # bf16 parameters held)
    fsdp_reshard_after_forward: str = "auto"
    # fsdp only: blocks whose all-gather a block issues ahead of its own compute (forward: the next
    # ones, backward: the previous ones); 0 leaves it to FSDP2's implicit prefetch
    fsdp_prefetch: int = 1

    def __post_init__(self):
        _choice("train.precision", self.precision, ("auto", "bf16", "fp32"))
        _choice("train.parallel", self.parallel, PARALLEL_MODES)
        _choice("train.device", self.device, ("auto", "cpu", "cuda"))
        _choice("train.twell_sizes", self.twell_sizes, ("deferred", "estimate", "late"))
        self.compile = _auto_bool("train.compile", self.compile)
        self.activation_checkpointing = _auto_bool(
            "train.activation_checkpointing", self.activation_checkpointing
        )
        self.fsdp_reshard_after_forward = _auto_bool(
            "train.fsdp_reshard_after_forward", self.fsdp_reshard_after_forward
        )
        _positive("train.fsdp_prefetch", self.fsdp_prefetch, allow_zero=True)
        for name in ("global_batch_tokens", "micro_batch", "seq_len", "steps"):
            _positive(f"train.{name}", getattr(self, name))
        _positive("train.grad_clip", self.grad_clip, allow_zero=True)
        _positive("train.peak_flops", self.peak_flops, allow_zero=True)
        self._refuse_what_cannot_work()
        rows = self.micro_batch * self.seq_len
        if self.global_batch_tokens % rows:
            raise ValueError(
                f"train.global_batch_tokens={self.global_batch_tokens} is not a multiple of "
                f"micro_batch * seq_len = {self.micro_batch} * {self.seq_len} = {rows}; "
                f"pick a global batch of k * {rows} tokens"
            )

    def _refuse_what_cannot_work(self) -> None:
        """Combinations no run can take, refused before anything is built, naming the one that works."""
        if self.twell_graphs and self.twell_sizes == "deferred":
            raise ValueError(
                "train.twell_graphs=true does not combine with train.twell_sizes=deferred: the TwELL op's "
                "per-layer graphs replay layers sized from their entry count read back "
                "(train.twell_sizes=estimate, the default); deferred layers never read it and would never "
                "replay. Set train.twell_sizes=estimate, or train.twell_graphs=false"
            )
        if not self.cuda_graph:
            return
        if self.twell_graphs:
            raise ValueError(
                "train.cuda_graph=true does not combine with train.twell_graphs=true: inside the step's one "
                "CUDA graph the TwELL op's per-layer graphs do not run (the step's graph already removes "
                "the op's host cost). Set train.twell_graphs=false, or train.cuda_graph=false for the "
                "per-layer graphs in eager or compiled steps"
            )
        if self.parallel == "fsdp":
            raise ValueError(
                "train.cuda_graph=true does not combine with train.parallel=fsdp: FSDP2's parameter gathers "
                "and gradient reduce-scatters cannot be captured. Set train.parallel=ddp (the graph holds the "
                "plain model and DDP averages the gradients after the replays), or keep fsdp with "
                "train.cuda_graph=false and train.compile=auto (each block compiled)"
            )
        if self.compile == "true":
            raise ValueError(
                "train.cuda_graph=true does not combine with train.compile=true: the step's capture "
                "(training/cuda_graph.py) holds eager blocks. Set train.compile=false to replay the step from "
                "a CUDA graph, or train.cuda_graph=false to compile each block (the faster one at the "
                "paper's sizes, docs/TRAINING.md)"
            )
        if self.activation_checkpointing == "true":
            raise ValueError(
                "train.cuda_graph=true does not combine with train.activation_checkpointing=true: the "
                "step's capture holds no recomputation in the backward. Set train.activation_checkpointing=auto (off "
                "under a graph) or false, with a smaller train.micro_batch if the step does not fit "
                "(python scripts/plan_memory.py), or train.cuda_graph=false"
            )
        if self.device == "cpu":
            raise ValueError(
                "train.cuda_graph=true needs a CUDA device, but train.device=cpu; set train.cuda_graph=false "
                "or train.device=auto on a GPU machine"
            )

    def compiles(self, on_gpu: bool = True) -> bool:
        """Whether the blocks go through torch.compile: compile=true, or auto on a GPU unless the step
        is replayed from a CUDA graph."""
        return self.compile == "true" or (self.compile == "auto" and on_gpu and not self.cuda_graph)

    def grad_accum(self, world_size: int) -> int:
        """Micro-steps per optimizer step on each rank; the global batch must split evenly."""
        per_step = self.micro_batch * self.seq_len * world_size
        if self.global_batch_tokens % per_step:
            raise ValueError(
                f"train.global_batch_tokens={self.global_batch_tokens} does not divide into "
                f"micro_batch * seq_len * world_size = {self.micro_batch} * {self.seq_len} * "
                f"{world_size} = {per_step}; change the global batch, the micro-batch or the "
                f"number of processes"
            )
        return self.global_batch_tokens // per_step


@dataclass
class SparsityConfig:
    """The L1 activation penalty and dead-unit re-initialisation (PAPER.md)."""

    l1_coef: float = 0.0
    l1_warmup_start: int = 0  # steps with the coefficient at 0 before the ramp starts
    l1_warmup_steps: int = 0  # linear ramp of the coefficient from 0 to l1_coef
    reinit_dead: bool = False
    reinit_period: int = 1  # re-initialise every this many optimizer steps
    # A unit is dead after this many tokens (all ranks) without firing, whatever the step's size: the
    # paper's 1,048,576 is one of its steps. 0: the last optimizer step's tokens.
    dead_window_tokens: int = 1_048_576
    reinit_lambda: float = 0.1  # W_g[j] <- (1 - lambda) W_g[j] + lambda N(0, sigma^2)
    reinit_sigma: float = 0.02
    reset_optimizer_moments: bool = False  # also zero that row's AdamW moments (paper is silent)
    # Re-draw dead rows with one Triton kernel per layer (kernels/reinit.py): only the dead rows are read
    # and written (1.8 against 7.2 ms a step at 1.5b on an H200), other noise than PyTorch's draw of the
    # whole matrix. auto: the kernel on a GPU, PyTorch's draw elsewhere; true needs CUDA.
    reinit_kernel: str = "auto"

    def __post_init__(self):
        _positive("sparsity.l1_coef", self.l1_coef, allow_zero=True)
        _positive("sparsity.l1_warmup_start", self.l1_warmup_start, allow_zero=True)
        _positive("sparsity.l1_warmup_steps", self.l1_warmup_steps, allow_zero=True)
        _positive("sparsity.reinit_period", self.reinit_period)
        _positive("sparsity.dead_window_tokens", self.dead_window_tokens, allow_zero=True)
        _positive("sparsity.reinit_sigma", self.reinit_sigma, allow_zero=True)
        if not 0.0 <= self.reinit_lambda <= 1.0:
            raise ValueError(f"sparsity.reinit_lambda={self.reinit_lambda} must be in [0, 1]")
        self.reinit_kernel = _auto_bool("sparsity.reinit_kernel", self.reinit_kernel)

    def reinit_by_kernel(self, on_gpu: bool) -> bool:
        """Whether dead rows are re-drawn by kernels/reinit.py (reinit_kernel: true, or auto on a GPU)."""
        return self.reinit_kernel == "true" or (self.reinit_kernel == "auto" and on_gpu)


@dataclass
class LoggingConfig:
    console: bool = True  # tqdm progress bar with the latest metrics
    jsonl: bool = True  # <run_dir>/metrics.jsonl, one record per logged step
    log_interval: int = 10  # optimizer steps between metric reads (the only host syncs of the loop)
    wandb_mode: str = "disabled"  # online | offline | disabled
    wandb_project: str = "twell"
    wandb_entity: str | None = None
    wandb_tags: list[str] = field(default_factory=list)
    # torch.profiler over the optimizer steps after step profile_at (0 = off): a trace and a summary of
    # where the step's time goes (GPU busy vs idle, GPU time by kind of kernel) under <run_dir>/profile/
    # and one JSONL / wandb record (training/profiling.py)
    profile_at: int = 0
    profile_steps: int = 3

    def __post_init__(self):
        _choice("logging.wandb_mode", self.wandb_mode, ("online", "offline", "disabled"))
        _positive("logging.log_interval", self.log_interval)
        _positive("logging.profile_at", self.profile_at, allow_zero=True)
        _positive("logging.profile_steps", self.profile_steps)


@dataclass
class CheckpointConfig:
    dir: str | None = None  # default: <run_dir>/checkpoints
    interval: int = 1000  # optimizer steps between checkpoints; 0 = only at the end / on SIGTERM
    keep_last: int = 3  # complete checkpoints kept on disk; 0 keeps all
    resume: str = "auto"  # auto (latest good one in dir, if any) | none | <path of a checkpoint>
    save_final: bool = True

    def __post_init__(self):
        _positive("checkpoint.interval", self.interval, allow_zero=True)
        _positive("checkpoint.keep_last", self.keep_last, allow_zero=True)


@dataclass
class EvalConfig:
    """Evaluation in the loop (docs/TRAINING.md): validation loss + bits per byte on every rank's
    share of the held-out data, and optionally an lm-eval subset on rank 0."""

    interval: int = 0  # optimizer steps between validation runs (val_loss, val_bpb); 0 = off
    val_batches: int = 8  # micro-batches per rank per validation run
    bpb_docs: int = 512  # held-out documents read once at start to measure bytes per token
    lm_eval_tasks: list[str] = field(default_factory=list)  # lm-eval tasks or presets; [] = off
    lm_eval_limit: int = 50  # examples per task; 0 = all
    lm_eval_batch_size: int = 16
    lm_eval_interval: int = 0  # optimizer steps between lm-eval runs; 0 = eval.interval

    def __post_init__(self):
        _positive("eval.interval", self.interval, allow_zero=True)
        _positive("eval.val_batches", self.val_batches)
        _positive("eval.bpb_docs", self.bpb_docs)
        _positive("eval.lm_eval_limit", self.lm_eval_limit, allow_zero=True)
        _positive("eval.lm_eval_batch_size", self.lm_eval_batch_size)
        _positive("eval.lm_eval_interval", self.lm_eval_interval, allow_zero=True)
        if self.lm_eval_tasks and not self.lm_eval_every:
            raise ValueError(
                f"eval.lm_eval_tasks={list(self.lm_eval_tasks)} would never run: eval.interval and "
                "eval.lm_eval_interval are both 0; set one of them (steps between runs)"
            )

    @property
    def lm_eval_every(self) -> int:
        """Steps between lm-eval runs (0 = never)."""
        return self.lm_eval_interval or self.interval if self.lm_eval_tasks else 0


@dataclass
class JobConfig:
    model: ModelConfig = MISSING
    data: DataConfig = MISSING
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sparsity: SparsityConfig = field(default_factory=SparsityConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    run_name: str = "run"
    # Deterministic (no timestamp) so every torchrun rank agrees on it and a restarted job finds
    # its own checkpoints.
    run_dir: str = "outputs/${run_name}"

    def __post_init__(self):
        max_len = getattr(self.model, "max_seq_len", None)
        if max_len is not None and self.train.seq_len > max_len:
            raise ValueError(
                f"train.seq_len={self.train.seq_len} exceeds model.max_seq_len={max_len}; "
                f"lower train.seq_len or raise model.max_seq_len"
            )

    @property
    def checkpoint_dir(self) -> str:
        return self.checkpoint.dir or f"{self.run_dir}/checkpoints"


def check_known_keys(cfg: DictConfig, prefix: str = "") -> None:
    """Refuse keys that no schema field takes (ValueError naming the key and the valid names).

    Hydra's `+group.key=value` (and `+key=value`) adds keys to a structured node anyway, and
    OmegaConf.to_object sets them as plain attributes, so a typo (`+optim.lrr=1`) would be ignored
    without a word. Every node typed by a dataclass is checked against its fields."""
    schema = OmegaConf.get_type(cfg)
    names = [f.name for f in dataclasses.fields(schema)] if dataclasses.is_dataclass(schema) else None
    for key in cfg.keys():
        path = f"{prefix}{key}"
        if names is not None and key not in names:
            where = prefix[:-1] or "the root config"
            raise ValueError(
                f"unknown config key {path!r}: {where} has no field {key!r}; the valid names are "
                f"{', '.join(names)}. Fix the spelling (and drop the leading +), or remove it"
            )
        value = cfg._get_node(key)
        if isinstance(value, DictConfig) and not value._is_missing() and not value._is_none():
            check_known_keys(value, f"{path}.")


def register_configs() -> None:
    """Make the schema known to Hydra; configs/train.yaml lists `job_schema` first in its defaults."""
    cs = ConfigStore.instance()
    cs.store(name="job_schema", node=JobConfig)


def parse_job(cfg: DictConfig) -> JobConfig:
    """The composed config as resolved, validated dataclasses (runs every __post_init__); ValueError names
    the bad value, also a key that no schema field takes (`+optim.lrr=1`)."""
    check_known_keys(cfg)
    try:
        job = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as err:
        raise ValueError(f"invalid configuration: {err}") from err
    if not isinstance(job, JobConfig):
        raise ValueError("the root config must compose onto `job_schema` (see configs/train.yaml)")
    return job
