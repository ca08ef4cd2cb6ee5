"""Validation loss and bits per byte on held-out batches (for the training loop and scripts/eval.py)."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F

IGNORE_INDEX = -100


def bytes_per_token(tokenizer, texts: Iterable[str]) -> float:
    """UTF-8 bytes per token of `texts` under `tokenizer` (no special tokens): the bpb denominator.

    Measure it once on a sample of the validation text and pass it to `validation_loss`.
    """
    n_bytes = n_tokens = 0
    for text in texts:
        n_bytes += len(text.encode("utf-8"))
        n_tokens += len(tokenizer(text, add_special_tokens=False)["input_ids"])
    if n_tokens == 0:
        raise ValueError("bytes_per_token needs at least one non-empty text")
    return n_bytes / n_tokens


@torch.no_grad()
def validation_loss(
    model, batches: Iterable[dict], bytes_per_token: float | None = None, max_batches: int | None = None
) -> dict[str, float]:
    """Token-weighted mean cross-entropy over `batches` ({"input_ids", "labels"}: int64 [B, S]).

    val_loss: nats per predicted token (labels == -100 are ignored).
    val_bpb:  bits per UTF-8 byte = val_loss / ln 2 / bytes_per_token (only if bytes_per_token
              is given; see `bytes_per_token()`).
    Distributed: every rank calls it with its own share; sums are all-reduced (a collective, so
    all ranks must call it the same number of times). Runs under bf16 autocast on CUDA; the
    model's train/eval mode is restored.
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total = torch.zeros((), dtype=torch.float64, device=device)
    count = torch.zeros((), dtype=torch.float64, device=device)
    try:
        for i, batch in enumerate(batches):
            if max_batches is not None and i >= max_batches:
                break
            input_ids = batch["input_ids"].to(device, non_blocking=True)
            labels = batch["labels"].to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                logits = model(input_ids, with_stats=False).logits
            loss = F.cross_entropy(
                logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
            )
            total += loss
            count += (labels != IGNORE_INDEX).sum()
    finally:
        model.train(was_training)
    if dist.is_available() and dist.is_initialized():
        sums = torch.stack([total, count])
        dist.all_reduce(sums)
        total, count = sums[0], sums[1]
    if count.item() == 0:
        raise ValueError("validation_loss got no target tokens (empty batches or all labels == -100)")
    val_loss = (total / count).item()
    out = {"val_loss": val_loss, "val_tokens": int(count.item())}
    if bytes_per_token is not None:
        if bytes_per_token <= 0:
            raise ValueError(f"bytes_per_token={bytes_per_token} must be positive")
        out["val_bpb"] = val_loss / math.log(2) / bytes_per_token
    return out
