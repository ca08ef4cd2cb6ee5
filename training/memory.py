"""Peak GPU memory of a training step, estimated from the shapes: what decides
`train.activation_checkpointing=auto` and what the trainer prints at start.

Per GPU, in bytes:
- parameters, gradients and AdamW's two moments in fp32 (16 bytes a parameter; FSDP2 divides them by
  the world size, DDP keeps them whole);
- activations saved for the backward pass, per token and layer, in an eager bf16-autocast step
  (counted from the model's code in model/layers.py and model/ffn.py):
    RMSNorm x2        fp32 input and normalised output: 8 d each
    q, k, v linears   their bf16 input casts: 3 x 2 d
    attention         q, k, v, out in bf16 (2 (2 d_q + 2 d_kv)), the fp32 log-sum-exp per head
    o linear          its bf16 input: 2 d
    FFN, dense        bf16 input casts of the gate and up linears (2 x 2 d), g, u, h (3 x 2 d_ff)
    FFN, TwELL        bf16 input (2 d) and the sparse state, ~0.12 bytes a unit at the paper's
                      activity (kernels: 78 MB for 16,384 tokens at d_ff 5632 with 1024 hot units)
  with activation checkpointing only each block's fp32 input (4 d) stays, plus one block's own
  activations while it is recomputed;
- the logits and the loss: bf16 logits, their fp32 copy and log-softmax, and the fp32 gradient
  (2 + 4 + 4 + 4 bytes a vocabulary entry and token);
- a fixed reserve for the CUDA context, cuBLAS workspaces and the allocator's fragmentation.
torch.compile fuses the element-wise ops and saves less: the estimate is then an upper bound.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30
RESERVE_BYTES = 2 * GIB  # CUDA context, cuBLAS/cuDNN workspaces, allocator slack
FIT_FRACTION = 0.9  # activation checkpointing goes off only when the estimate fits in this share


@dataclass(frozen=True)
class MemoryEstimate:
    params: int
    grads: int
    optimizer: int
    activations: int
    logits: int
    reserve: int
    activation_checkpointing: bool
    sparse_ffn: bool

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.logits + self.reserve

    def describe(self) -> str:
        parts = ("params", "grads", "optimizer", "activations", "logits", "reserve")
        body = ", ".join(f"{name} {getattr(self, name) / GIB:.1f}" for name in parts)
        return f"{self.total / GIB:.1f} GiB ({body})"


def block_activation_bytes_per_token(cfg, sparse_ffn: bool) -> int:
    """Bytes one block saves for its backward pass, per token (eager, bf16 autocast)."""
    d, f = cfg.d_model, cfg.d_ff
    d_q, d_kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    norms = 2 * 8 * d
    attention = 3 * 2 * d + 2 * (2 * d_q + 2 * d_kv) + 4 * cfg.n_heads + 2 * d_q
    ffn = 2 * d + int(0.12 * f) if sparse_ffn else 2 * 2 * d + 3 * 2 * f
    return norms + attention + ffn


def estimate_training_memory(
    cfg, micro_batch: int, seq_len: int, *, activation_checkpointing: bool, sparse_ffn: bool,
    world_size: int = 1, sharded: bool = False,
) -> MemoryEstimate:  # fmt: skip
    """The peak of one training step on one GPU; `cfg` a ModelConfig, `sharded` FSDP2 over world_size."""
    n_params = cfg.num_params()
    shard = world_size if sharded else 1
    state = 4 * n_params // shard
    tokens = micro_batch * seq_len
    per_block = block_activation_bytes_per_token(cfg, sparse_ffn) * tokens
    if activation_checkpointing:
        activations = cfg.n_layers * 4 * cfg.d_model * tokens + per_block
    else:
        activations = cfg.n_layers * per_block
    logits = (2 + 4 + 4 + 4) * cfg.vocab_size * tokens
    return MemoryEstimate(
        params=state, grads=state, optimizer=2 * state, activations=activations, logits=logits,
        reserve=RESERVE_BYTES, activation_checkpointing=activation_checkpointing, sparse_ffn=sparse_ffn,
    )  # fmt: skip


def choose_activation_checkpointing(
    cfg, micro_batch: int, seq_len: int, device_bytes: int, *, sparse_ffn: bool, world_size: int = 1,
    sharded: bool = False,
) -> tuple[bool, MemoryEstimate, MemoryEstimate]:  # fmt: skip
    """(checkpoint?, estimate without, estimate with): off when the step fits in FIT_FRACTION of the
    device's memory without it, on otherwise."""
    kw = dict(sparse_ffn=sparse_ffn, world_size=world_size, sharded=sharded)
    without = estimate_training_memory(cfg, micro_batch, seq_len, activation_checkpointing=False, **kw)
    with_ac = estimate_training_memory(cfg, micro_batch, seq_len, activation_checkpointing=True, **kw)
    return without.total > FIT_FRACTION * device_bytes, without, with_ac
