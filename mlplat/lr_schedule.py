"""The learning-rate schedule: linear warm-up to optim.lr, then cosine decay to optim.min_lr at the last step."""
from __future__ import annotations

import math

from mlplat.config import OptimConfig


def lr_factor(step: int, optim_cfg: OptimConfig, max_steps: int) -> float:
    """The learning rate at optimizer step `step` (0-based) as a fraction of optim.lr (LambdaLR's factor)."""
    warm = optim_cfg.warmup_steps
    if step < warm:
        return (step + 1) / warm
    progress = min(1.0, (step - warm) / max(1, max_steps - warm))
    lr = optim_cfg.min_lr + 0.5 * (optim_cfg.lr - optim_cfg.min_lr) * (1 + math.cos(math.pi * progress))
    return lr / optim_cfg.lr
