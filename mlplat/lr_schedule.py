"""The learning-rate schedule: linear warm-up to optim.lr, then cosine decay to optim.min_lr at its horizon,
optim.lr_decay_steps (null: trainer.max_steps), after which it holds optim.min_lr.

A run's schedule is part of its checkpoint (`CosineSchedule`'s state: its peak, floor, warm-up and horizon), so a
resume keeps it whatever the command line says: a longer trainer.max_steps continues at optim.min_lr instead of
recomputing the cosine over the new length (Megatron separates the decay horizon from the run's length the same
way). optim.lr_decay_steps given on the resumed command line moves the horizon; the other schedule keys given there
that differ from the checkpoint's are named in one line, and not applied.
"""
from __future__ import annotations

import logging
import math

import torch

from mlplat.config import OptimConfig

log = logging.getLogger("mlplat")
KEPT = ("lr", "min_lr", "warmup_steps")  # the optim.* keys a resume takes from its checkpoint's schedule


def lr_factor(step: int, optim_cfg: OptimConfig, horizon: int) -> float:
    """The learning rate at optimizer step `step` (0-based) as a fraction of optim.lr (LambdaLR's factor), the
    cosine reaching optim.min_lr at step `horizon`."""
    return _factor(step, optim_cfg.lr, optim_cfg.min_lr, optim_cfg.warmup_steps, horizon)


def _factor(step: int, lr: float, min_lr: float, warmup_steps: int, horizon: int) -> float:
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, horizon - warmup_steps))
    return (min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * progress))) / lr


class CosineSchedule(torch.optim.lr_scheduler.LambdaLR):
    """`lr_factor` over `optimizer`, its keys and horizon held as state (plain data: a checkpoint saves it, and
    `load_state_dict` restores it, optim.lr_decay_steps given on the command line taking the horizon). The resume of
    a checkpoint (`resuming` set by the caller first) says in one line what it took from where; post-validation's
    restores of the same run's state say nothing."""

    LOCAL = ("_given", "_rank", "resuming", "fresh_groups")  # this process's, not the schedule's: never saved

    def __init__(self, optimizer: torch.optim.Optimizer, optim_cfg: OptimConfig, max_steps: int, rank: int = 0):
        self.keys = {k: getattr(optim_cfg, k) for k in KEPT}
        self.horizon = optim_cfg.lr_decay_steps or max_steps
        self._given, self._rank, self.resuming = optim_cfg, rank, False
        # set by the caller when the checkpoint is another optimizer's (`mlplat.checkpoint.io.FRESH_STATE`): its
        # per-group peaks are not this optimizer's groups', which keep theirs
        self.fresh_groups = False
        super().__init__(optimizer, lambda step: _factor(step, horizon=self.horizon, **self.keys))

    def state_dict(self) -> dict:
        return {k: v for k, v in super().state_dict().items() if k not in self.LOCAL}

    def load_state_dict(self, state_dict: dict) -> None:
        given, keys, peaks = self._given, dict(self.keys), list(self.base_lrs)
        super().load_state_dict(state_dict)  # the checkpoint's keys and horizon (older checkpoints: this run's)
        moved = given.lr_decay_steps is not None and given.lr_decay_steps != self.horizon
        if moved:
            self.horizon = given.lr_decay_steps
        if self.fresh_groups:  # this optimizer's groups at the checkpoint's point of the schedule
            self.base_lrs, self.fresh_groups = peaks, False
            self._last_lr = [peak * self.lr_lambdas[0](self.last_epoch) for peak in peaks]
            for group, lr in zip(self.optimizer.param_groups, self._last_lr):
                group["lr"] = lr
        differ = [f"optim.{k}={keys[k]} (the checkpoint's: {self.keys[k]})" for k in KEPT if keys[k] != self.keys[k]]
        said, self.resuming = self.resuming, False
        if said and self._rank == 0:
            log.info("resumed learning-rate schedule: the checkpoint's (optim.lr=%g, optim.min_lr=%g, "
                     "optim.warmup_steps=%d), cosine to step %d%s%s", self.keys["lr"], self.keys["min_lr"],
                     self.keys["warmup_steps"], self.horizon, " (optim.lr_decay_steps, given)" if moved else "",
                     f"; given and not applied: {', '.join(differ)}" if differ else "")
