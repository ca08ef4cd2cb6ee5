"""Learning-rate schedules as pure functions of the step: nothing to checkpoint but the step itself.

The paper's recipe is linear warm-up then cosine to 0 (PAPER.md). WSD (warm-up, stable, decay) is the
option for runs whose length is not known in advance: the stable phase can be extended and the decay
started from any checkpoint.
"""

import math

SCHEDULES = ("cosine", "wsd", "constant")


def lr_factor(
    step: int,
    total_steps: int,
    schedule: str,
    warmup_steps: int,
    min_lr_ratio: float = 0.0,
    decay_fraction: float = 0.2,
) -> float:
    """Multiplier of the peak LR for the optimizer update that follows `step` completed updates.

    Warm-up is linear from 1/warmup_steps to 1 (the first update already moves the weights);
    cosine decays from 1 at the end of warm-up to `min_lr_ratio` at `total_steps`; WSD holds 1 until
    the last `decay_fraction` of the run, then decays linearly to `min_lr_ratio`.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is unknown; use one of {SCHEDULES}")
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    if schedule == "cosine":
        span = max(total_steps - warmup_steps, 1)
        progress = min((step - warmup_steps) / span, 1.0)
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    decay_steps = max(round(decay_fraction * total_steps), 1)
    decay_start = max(total_steps - decay_steps, warmup_steps)
    if step < decay_start:
        return 1.0
    progress = min((step - decay_start) / max(total_steps - decay_start, 1), 1.0)
    return min_lr_ratio + (1.0 - min_lr_ratio) * (1.0 - progress)
