"""Steps skipped for an inf/NaN loss or gradient norm (`SkippedSteps`): counted over the run, and
optim.max_skipped_steps of them in a row stop training (`DivergenceError`). Every rank reads the same all-reduced
loss and norm, so all count (and stop) together."""
from __future__ import annotations

import logging
import math

import torch

from mlplat.errors import DivergenceError
from mlplat.optim.loss_scale import DynamicLossScaler

log = logging.getLogger("mlplat")


class SkippedSteps:
    def __init__(self, limit: int, rank: int):
        self.limit, self.rank = limit, rank  # optim.max_skipped_steps; the rank that logs
        self.total = 0  # over the run (a checkpoint keeps it)
        self.in_a_row = 0

    def count(self, step: int, skipped: bool, scaler: DynamicLossScaler | None) -> None:
        """A settled step: skipped (its loss or norm inf/NaN) or standing. `scaler`'s scale is the one the step ran
        at (it backs off after)."""
        if not skipped:
            self.in_a_row = 0
            return
        self.total += 1
        self.in_a_row += 1
        if self.rank == 0:
            scale = (f" at loss scale {scaler.scale:g}, scale -> "
                     f"{max(scaler.min_scale, scaler.scale * scaler.backoff_factor):g}" if scaler is not None else "")
            log.warning("step %d: inf/NaN loss or gradients%s; optimizer step skipped (%d in a row, at most %d)",
                        step, scale, self.in_a_row, self.limit)
        if self.in_a_row >= self.limit:
            raise DivergenceError(f"step {step}: the loss or the gradient norm was inf/NaN at {self.in_a_row} steps "
                                  f"in a row (optim.max_skipped_steps={self.limit}): training stopped")


def finite(loss: torch.Tensor, norm: torch.Tensor) -> bool:
    """Both on the host: the record reads them there anyway."""
    return math.isfinite(float(loss)) and math.isfinite(float(norm))
