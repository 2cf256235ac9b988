"""Learning-rate schedule: linear warm-up, then cosine decay to a floor."""

from __future__ import annotations

import math

from shoal.config import OptimConfig


def learning_rate(step: int, optim: OptimConfig, total_steps: int) -> float:
    """The learning rate for optimizer step `step` (0-based) of a run of `total_steps` steps."""
    if optim.warmup_steps > 0 and step < optim.warmup_steps:
        return optim.lr * (step + 1) / optim.warmup_steps
    decay_steps = max(1, total_steps - optim.warmup_steps)
    progress = min(1.0, (step - optim.warmup_steps) / decay_steps)
    floor = optim.lr * optim.min_lr_ratio
    return floor + (optim.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
