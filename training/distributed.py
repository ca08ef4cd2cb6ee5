"""Process-group setup for one process or `torchrun` (DDP or FSDP2): gloo on CPU, NCCL on GPU."""

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

# gloo group next to an NCCL default group; None when the default group is gloo already.
_CPU_GROUP = None


@dataclass
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def resolve_device(preference: str, local_rank: int = 0) -> torch.device:
    if preference == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            "train.device=cuda but no CUDA GPU is visible (torch.cuda.is_available() is False); use train.device=auto or cpu"
        )
    if preference == "cpu" or (preference == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    return torch.device("cuda", local_rank)


def init_distributed(device_preference: str = "auto") -> DistInfo:
    """Read torchrun's environment; start the process group only when there is more than one rank."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(device_preference, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world_size > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend=backend, timeout=timedelta(minutes=30), **kwargs)
        if backend == "nccl":
            # Small host-side collectives (the stop flag) go through gloo so they never wait on
            # the GPU stream; every rank creates it here, at the same point.
            global _CPU_GROUP
            _CPU_GROUP = dist.new_group(backend="gloo")
    return DistInfo(rank=rank, local_rank=local_rank, world_size=world_size, device=device)


def _one_rank_group(device: torch.device) -> None:
    """A process group of this process alone (an in-memory store: no rendezvous, no port), so FSDP2
    can shard over a one-rank mesh when train.parallel=fsdp runs without torchrun."""
    if dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)


def fsdp_block_reshards(n_blocks: int, setting: str, world_size: int) -> list[bool]:
    """Per block, whether FSDP2 frees its gathered parameters after the forward (train.fsdp_reshard_after_forward):
    true, every block (least memory: each block is gathered again for its backward); false, none (one
    gather per micro-batch; every block's gathered parameters are held from its forward to its backward);
    auto, every block but the last, which the backward needs first (gathering it again would follow at
    once), and none on one rank: there a gather is a whole-model bf16 cast that frees nothing a plain run
    keeps (its autocast holds the same bf16 weights from the forward to the backward)."""
    if setting == "auto":
        return [world_size > 1 and index < n_blocks - 1 for index in range(n_blocks)]
    return [setting == "true"] * n_blocks


def shard_model(
    model: nn.Module,
    device: torch.device,
    *,
    bf16: bool,
    reshard_after_forward: str = "auto",
    prefetch: int = 1,
) -> list[nn.Module]:
    """FSDP2 (`fully_shard`) over all ranks, one rank included: each transformer block is one shard
    group, then the root (token embedding, which is also the tied output head, and the final norm) is
    one more.

    Call after the per-block wrappers (activation checkpointing, torch.compile), with `model.layers`
    holding the wrapped blocks, and before the optimizer is built: the parameters become fp32 DTensors
    sharded on dim 0 (the master weights; AdamW's moments follow them) and the module classes change in
    place (names and state-dict keys do not).

    bf16 (train.precision=bf16): the blocks' parameters are gathered and computed in bf16 and their
    gradients reduce-scattered (and accumulated over micro-batches) in fp32 (MixedPrecisionPolicy). A
    block's inputs are not cast: the residual stream stays fp32 as under DDP's autocast, and the root
    keeps fp32 parameters for the same reason (a bf16 embedding would make the whole stream bf16; its use
    as the output head is cast to bf16 by autocast, as under DDP). Otherwise fp32 throughout.

    prefetch: each block issues the all-gather of the next `prefetch` blocks at the start of its forward
    (and of the `prefetch` blocks before it in the backward), so a host sync inside a block (the TwELL
    op's exact-size calls) cannot delay the next gather; 0 leaves FSDP2's implicit prefetch alone.

    Returns the modules that stay gathered from their forward to their backward (the blocks that do not
    reshard after the forward, and the root once every block does not): set_gathered_between_micro_batches
    keeps them gathered from one micro-batch to the next as well."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    _one_rank_group(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    if bf16:
        block_policy = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False
        )
    else:
        block_policy = MixedPrecisionPolicy()
    blocks = list(model.layers)
    reshards = fsdp_block_reshards(len(blocks), reshard_after_forward, dist.get_world_size())
    for block, reshard in zip(blocks, reshards):
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=block_policy)
    fully_shard(model, mesh=mesh)  # fp32 parameters, fp32 reduction
    held = [block for block, reshard in zip(blocks, reshards) if not reshard]
    if prefetch:
        model.set_modules_to_forward_prefetch(blocks[:prefetch])
        for index, block in enumerate(blocks):
            block.set_modules_to_forward_prefetch(blocks[index + 1 : index + 1 + prefetch])
            block.set_modules_to_backward_prefetch(blocks[max(0, index - prefetch) : index][::-1])
    # FSDP2 never reshards the root after its forward; it is worth holding with the blocks when they all are
    return held + [model] if len(held) == len(blocks) else held


def set_gathered_between_micro_batches(held: list[nn.Module], last: bool) -> None:
    """Before a micro-batch: whether the modules shard_model returned reshard after its backward (only after
    the step's last micro-batch, whose gradients the optimizer applies to the shards; the gathered copies
    are stale from then on). In between they stay gathered for the next micro-batch's forward, which then
    gathers nothing: they hold no more memory than from their forward to their backward, which they
    already do. On one rank a gather is a bf16 cast of the whole model, which this saves at every
    micro-batch but the first (plain training casts at every one)."""
    for module in held:
        module.set_reshard_after_backward(last, recurse=False)


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def all_reduce_(tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce that is a no-op in a single process."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=op)
    return tensor


def any_rank(flag: bool) -> bool:
    """True if `flag` is true on any rank (a host-side collective; used for the stop signal)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return flag
    value = torch.tensor([int(flag)], dtype=torch.int32)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=_CPU_GROUP)
    return bool(value.item())


def destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
