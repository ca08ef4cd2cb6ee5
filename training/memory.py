"""Peak GPU memory of a training step, estimated from the shapes: what decides
`train.activation_checkpointing=auto` and what the trainer prints at start.

Per GPU, in bytes:
- parameters and AdamW's two moments in fp32 (4 + 8 bytes a parameter; FSDP2 divides them by the world
  size, one process and DDP keep them whole);
- gradients in fp32: 4 bytes a parameter, sharded under FSDP2; DDP holds them twice (the parameters'
  .grad and its all-reduce buckets); FSDP2 with grad_accum > 1 also holds every parameter's unsharded
  fp32 gradient between micro-batches (no reduce-scatter until the step's last one);
- the weights as the step computes with them ("compute_weights"): under bf16 autocast (one process,
  DDP) a bf16 copy of every matrix (2 bytes a parameter), saved for the backward pass; under FSDP2 the
  gathered, unsharded parameters: the root's in fp32 (token embedding, which is also the output head,
  whose bf16 cast autocast saves as well, and the final norm: gathered once and held through the backward)
  and the blocks' in bf16 (fp32 without bf16): the block being computed and the ones prefetched
  (train.fsdp_prefetch, at least FSDP2's own one) at the peak, or every block when
  train.fsdp_reshard_after_forward=false (or auto on one rank) keeps them from the forward to the backward;
- activations saved for the backward pass, per token and layer (block_bytes_besides_sparse_state), in an
  eager bf16-autocast step (counted from the model's code in model/layers.py and model/ffn.py):
    RMSNorm x2        fp32 input and normalised output: 8 d each
    q, k, v linears   their bf16 input casts: 3 x 2 d
    attention         q, k, v, out in bf16 (2 (2 d_q + 2 d_kv)), the fp32 log-sum-exp per head
    o linear          its bf16 input: 2 d
    FFN, dense        bf16 input casts of the gate and up linears (2 x 2 d), g, u, h (3 x 2 d_ff)
    FFN, TwELL        bf16 input (2 d) and the training op's sparse state (sparse_ffn_state_bytes):
                      per token the hot units' gate and up values (2 x 2 K; K = 1024 hot units from
                      16,384 tokens a micro-batch), 14 bytes an active entry at the paper's activity
                      (29 units a token, counted as if none were hot) and the row offsets; per layer
                      the hot units' gathered weight rows (3 x 2 K d)
  with activation checkpointing only each block's fp32 input (4 d) stays, plus one block's own
  activations while it is recomputed; a compiled TwELL block also keeps its FFN's sparse state, which
  the recomputation takes instead of running the FFN again (selective checkpointing,
  kernels.training.train.checkpoint_context, torch >= 2.12.1; `keep_ffn_state`; the op's output is
  not kept, the backward pass needs none of it: measured on the CPU, tests/training/test_memory.py);
- the logits and the loss: bf16 logits, their fp32 copy and log-softmax, and the fp32 gradient
  (2 + 4 + 4 + 4 bytes a vocabulary entry and token);
- a fixed reserve for the CUDA context, cuBLAS workspaces and the allocator's fragmentation.
The peak is the larger of two moments, not the sum of every part: the end of the forward pass (the
saved activations and the logits; gradients only where they outlive a step's start: accumulated over
micro-batches, or DDP's buckets, since zero_grad frees them otherwise) and the backward pass (every
gradient, the saved activations and, with checkpointing, the block being recomputed; the logits are
gone by then). Measured against eager steps on an H200 (bench_memory.py, 0.5b and 1.5b, dense and
TwELL, checkpointing on and off; docs/results/memory/) the sum was 3-26% over the reserved peak, the
larger of the two moments is within -7%..+2% (TwELL with checkpointing was measured before its blocks
kept their FFN state: not re-measured since).
Blocks through torch.compile (the default on a GPU) save less: inductor's partitioner recomputes the
norms' outputs and the casts in the backward pass instead of keeping them, and one bf16 normalised input
serves q, k and v; the saved set was measured on the CPU (tests/training/test_memory.py fails if a torch
release changes it), ~0.66x an eager dense block and ~0.53x an eager TwELL one besides its state at 1.5b.
With it the estimate is within -3.7%..-0.6% of the allocated peaks of compiled steps on an H200 (0.5b and
1.5b, dense and TwELL, no checkpointing), where the eager model overshot by 13-27% and made `auto`
checkpoint runs that fit (paper_1.5b on an 80 GiB GPU). scripts/bench_memory.py measures either
(--compile) against the plan.
"""

from __future__ import annotations

from dataclasses import dataclass

# The training op's default hot units on a GPU (kernels.inference.inference.default_hot_units, which
# takes none under the interpreter: the planner plans for the GPU).
from twell.kernels.inference.inference import DEFAULT_HOT_UNITS, HOT_MIN_TOKENS
from twell.kernels.training.train import compiled_selective_checkpointing
from twell.training.distributed import fsdp_block_reshards

GIB = 2**30
RESERVE_BYTES = 2 * GIB  # CUDA context, cuBLAS/cuDNN workspaces, allocator slack
FIT_FRACTION = 0.9  # activation checkpointing goes off only when the estimate fits in this share


@dataclass(frozen=True)
class MemoryEstimate:
    params: int
    grads: int
    optimizer: int
    compute_weights: int
    activations: int  # saved for the backward pass through the whole step
    logits: int
    reserve: int
    activation_checkpointing: bool
    sparse_ffn: bool
    grads_in_forward: int = 0  # gradients alive at the end of the forward pass (see the module doc)
    recompute: int = 0  # with checkpointing: the activations of the block being recomputed

    PARTS = ("params", "grads", "optimizer", "compute_weights", "activations", "logits", "reserve")

    @property
    def forward_peak(self) -> int:
        return self.grads_in_forward + self.activations + self.logits

    @property
    def backward_peak(self) -> int:
        return self.grads + self.activations + self.recompute

    @property
    def total(self) -> int:
        held = self.params + self.optimizer + self.compute_weights + self.reserve
        return held + max(self.forward_peak, self.backward_peak)

    def describe(self) -> str:
        body = ", ".join(f"{name} {getattr(self, name) / GIB:.1f}" for name in self.PARTS)
        moment = "forward" if self.forward_peak >= self.backward_peak else "backward"
        return f"{self.total / GIB:.1f} GiB at the end of the {moment} pass ({body})"


# Active units a token that the sparse state is sized for: the paper's activity (model/calibrate.py).
PAPER_ACTIVE_UNITS = 29
ENTRY_BYTES = 4 + 4 + 2 + 4  # an active entry's row, column, bf16 gate and fp32 up value


def hot_units(cfg, tokens: int) -> int:
    """Hot units the training op takes for a micro-batch of `tokens` (model.twell_hot_units, else the
    kernels' default on a GPU)."""
    if cfg.twell_hot_units is not None:
        return min(cfg.twell_hot_units, cfg.d_ff)
    return min(DEFAULT_HOT_UNITS, cfg.d_ff // 4) if tokens >= HOT_MIN_TOKENS else 0


def sparse_ffn_state_bytes(cfg, tokens: int) -> tuple[int, int]:
    """(bytes a token, bytes a layer) of what the TwELL training op saves for its backward pass beside
    its input: the hot units' gate and up values, the active entries, row offsets and counts; the hot
    units' gathered weight rows."""
    k = hot_units(cfg, tokens)
    per_token = 2 * 2 * k + ENTRY_BYTES * PAPER_ACTIVE_UNITS + 4 + 4
    return per_token, 3 * 2 * k * cfg.d_model


def block_bytes_besides_sparse_state(cfg, sparse_ffn: bool, compiled: bool = False) -> int:
    """Bytes one block saves for its backward pass per token (bf16 autocast), all but the TwELL op's sparse
    state (sparse_ffn_state_bytes). Eager: counted from the model's code (the module doc). Compiled as the
    trainer compiles (one graph a block, the TwELL op inside it), inductor keeps less (measured on the CPU,
    tests/training/test_memory.py): the fp32 block input and each norm's fp32 1/rms (the normalised rows
    and the residual sum between the two halves are recomputed), one bf16 normalised input for q, k and v,
    q/k/v/out and the log-sum-exp, the o projection's and the FFN's bf16 inputs, a dense FFN's g, u, h."""
    d, f = cfg.d_model, cfg.d_ff
    d_q, d_kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    attention = 2 * (2 * d_q + 2 * d_kv) + 4 * cfg.n_heads + 2 * d_q  # q, k, v, out, lse; o's input
    if compiled:
        norms, attention, ffn_input = 4 * d + 2 * 4, attention + 2 * d, 2 * d
    else:
        norms, attention, ffn_input = 2 * 8 * d, attention + 3 * 2 * d, (2 if sparse_ffn else 2 * 2) * d
    return norms + attention + ffn_input + (0 if sparse_ffn else 3 * 2 * f)


def block_activation_bytes_per_token(cfg, sparse_ffn: bool, tokens: int, compiled: bool = False) -> int:
    """Bytes one block saves for its backward pass, per token of a micro-batch of `tokens` (bf16
    autocast; eager, or compiled with torch.compile)."""
    per_token, per_layer = sparse_ffn_state_bytes(cfg, tokens) if sparse_ffn else (0, 0)
    return block_bytes_besides_sparse_state(cfg, sparse_ffn, compiled) + per_token + per_layer // tokens


def root_params(cfg) -> int:
    """Parameters outside the blocks: the token embedding (and an untied output head), the final norm."""
    return cfg.vocab_size * cfg.d_model * (1 if cfg.tie_embeddings else 2) + cfg.d_model


def fsdp_gathered_blocks(n_layers: int, reshard_after_forward: str, prefetch: int, world_size: int) -> int:
    """Blocks whose unsharded parameters FSDP2 holds at the step's peak (the start of the backward pass):
    every one when none is resharded after its forward (false, or auto on one rank:
    training.distributed.fsdp_block_reshards); else the block computed and those prefetched (FSDP2
    prefetches one itself when train.fsdp_prefetch=0)."""
    if not any(fsdp_block_reshards(n_layers, reshard_after_forward, world_size)):
        return n_layers
    return min(n_layers, 1 + max(prefetch, 1))


def estimate_training_memory(
    cfg, micro_batch: int, seq_len: int, *, activation_checkpointing: bool, sparse_ffn: bool,
    world_size: int = 1, sharded: bool = False, bf16: bool = True, grad_accum: int = 1,
    reshard_after_forward: str = "auto", prefetch: int = 1, keep_ffn_state: bool = False,
    compiled: bool = False, bucket_views: bool = True,
) -> MemoryEstimate:  # fmt: skip
    """The peak of one training step on one GPU; `cfg` a ModelConfig; `sharded`: FSDP2 over world_size
    processes (one included), else one process or DDP; bf16: bf16 autocast / FSDP2's bf16 gathers;
    grad_accum, reshard_after_forward and prefetch as train.* has them (the last two: FSDP2 only);
    keep_ffn_state: checkpointed sparse blocks keep their FFN's sparse state (compiled blocks do);
    compiled: the blocks go through torch.compile (what they save: block_activation_bytes_per_token);
    bucket_views: DDP's gradients are views into its all-reduce buckets (the trainer's default; not under
    CUDA graphs), else the buckets are a second fp32 copy."""
    n_params = cfg.num_params()
    shard = world_size if sharded else 1
    state = 4 * n_params // shard
    grads = state
    held_grads = state if grad_accum > 1 else 0  # a later micro-batch's forward runs on accumulated .grad
    if sharded and grad_accum > 1:
        grads += 4 * n_params  # unsharded fp32 gradients accumulated between micro-batches
        held_grads = grads
    elif not sharded and world_size > 1:  # DDP's all-reduce buckets: allocated once, kept through the forward
        if bucket_views:  # .grad is a view into them: one copy, alive all the time
            held_grads = grads
        else:  # besides .grad
            grads += 4 * n_params
            held_grads += 4 * n_params
    compute_bytes = 2 if bf16 else 4
    if sharded:
        root = root_params(cfg)
        blocks = fsdp_gathered_blocks(cfg.n_layers, reshard_after_forward, prefetch, world_size)
        head_cast = 2 * cfg.vocab_size * cfg.d_model if bf16 else 0
        compute_weights = 4 * root + head_cast + compute_bytes * blocks * (n_params - root) // cfg.n_layers
    else:
        compute_weights = 2 * n_params if bf16 else 0
    tokens = micro_batch * seq_len
    per_block = block_activation_bytes_per_token(cfg, sparse_ffn, tokens, compiled) * tokens
    if activation_checkpointing:
        kept = 4 * cfg.d_model * tokens  # the block's fp32 input
        if sparse_ffn and keep_ffn_state:  # and its FFN's sparse state (selective checkpointing)
            per_token, per_layer = sparse_ffn_state_bytes(cfg, tokens)
            kept += per_token * tokens + per_layer  # (not the op's output y: the backward needs none)
        activations, recompute = cfg.n_layers * kept, per_block
    else:
        activations, recompute = cfg.n_layers * per_block, 0
    logits = (2 + 4 + 4 + 4) * cfg.vocab_size * tokens
    return MemoryEstimate(
        params=state, grads=grads, optimizer=2 * state, compute_weights=compute_weights,
        activations=activations, logits=logits, reserve=RESERVE_BYTES,
        activation_checkpointing=activation_checkpointing, sparse_ffn=sparse_ffn,
        grads_in_forward=held_grads, recompute=recompute,
    )  # fmt: skip


def job_settings(job, world_size: int, sharded: bool) -> dict:
    """estimate_training_memory's keyword arguments for a JobConfig on a GPU (precision auto is bf16
    there, compile auto on unless under a CUDA graph; an "auto" FFN starts dense, so it is estimated
    dense), activation checkpointing left out."""
    tcfg = job.train
    compiled = tcfg.compiles()
    return dict(
        sparse_ffn=job.model.ffn_impl == "twell", world_size=world_size, sharded=sharded,
        bf16=tcfg.precision != "fp32", grad_accum=tcfg.grad_accum(world_size),
        reshard_after_forward=tcfg.fsdp_reshard_after_forward, prefetch=tcfg.fsdp_prefetch,
        keep_ffn_state=compiled and compiled_selective_checkpointing(), compiled=compiled,
        bucket_views=not tcfg.cuda_graph,
    )  # fmt: skip


def choose_activation_checkpointing(
    cfg, micro_batch: int, seq_len: int, device_bytes: int, **settings
) -> tuple[bool, MemoryEstimate, MemoryEstimate]:
    """(checkpoint?, estimate without, estimate with): off when the step fits in FIT_FRACTION of the
    device's memory without it, on otherwise. settings: estimate_training_memory's keyword arguments
    other than activation_checkpointing (sparse_ffn among them)."""
    without = estimate_training_memory(cfg, micro_batch, seq_len, activation_checkpointing=False, **settings)
    with_ac = estimate_training_memory(cfg, micro_batch, seq_len, activation_checkpointing=True, **settings)
    return without.total > FIT_FRACTION * device_bytes, without, with_ac
