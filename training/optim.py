"""AdamW with the paper's recipe and the LR schedule applied by step."""

import torch
from torch import nn

from twell.training.config import OptimConfig
from twell.training.schedule import lr_factor


def param_groups(model: nn.Module, cfg: OptimConfig) -> list[dict]:
    """Matrices (and the tied embedding) get weight decay; 1-D norm gains only if asked."""
    decay, no_decay = [], []
    for _, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (decay if param.ndim >= 2 or cfg.decay_norm_gains else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def build_optimizer(model: nn.Module, cfg: OptimConfig, device: torch.device) -> torch.optim.AdamW:
    # The fused CUDA kernel does the whole update in a few launches and never syncs with the host.
    fused = device.type == "cuda"
    return torch.optim.AdamW(
        param_groups(model, cfg),
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        fused=fused,
        foreach=None if fused else True,
    )


def set_lr(optimizer: torch.optim.Optimizer, cfg: OptimConfig, step: int, total_steps: int) -> float:
    """Set the LR of the update that follows `step` completed updates; returns it."""
    lr = cfg.lr * lr_factor(
        step, total_steps, cfg.schedule, cfg.warmup_steps, cfg.min_lr_ratio, cfg.decay_fraction
    )
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr
