"""Process-group setup for one process or `torchrun` (DDP): gloo on CPU, NCCL on GPU."""

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

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
