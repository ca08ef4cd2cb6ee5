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
        raise RuntimeError("train.device=cuda but no CUDA GPU is visible; use train.device=auto or cpu")
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


def shard_model(model: nn.Module, device: torch.device) -> None:
    """FSDP2 (`fully_shard`) over all ranks: each transformer block is one shard group, then the root
    (token embedding, which is also the tied output head, and the final norm) is one more.

    Call after the per-block wrappers (activation checkpointing, torch.compile), with `model.layers`
    holding the wrapped blocks, and before the optimizer is built: the parameters become DTensors
    sharded on dim 0 and the module classes change in place (names and state-dict keys do not).
    No MixedPrecisionPolicy: the fp32 parameters are gathered as they are and the trainer's bf16
    autocast casts inside each op, as under DDP, so the numbers match DDP's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    blocks = list(model.layers)
    for index, block in enumerate(blocks):
        # The last block runs first in the backward pass: resharding it after the forward would
        # only gather it again at once.
        fully_shard(block, mesh=mesh, reshard_after_forward=index < len(blocks) - 1)
    fully_shard(model, mesh=mesh)


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
