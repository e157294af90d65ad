"""Multi-token prediction's part in each training step (`MTPStep`, a `mlplat.step.hooks.StepHook`): each depth's
loss over the step, reported as `mtp_loss/depth<k>` (`mtp_loss_columns`). The modules' arithmetic is
`mlplat.model.mtp`'s; this is its bookkeeping over a step."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from mlplat.config import ModelConfig
from mlplat.model.mtp import mtp_modules
from mlplat.parallel.grid import ParallelGrid


def mtp_loss_columns(model: ModelConfig) -> list[str]:
    """The names of the depths' losses ([] without multi-token prediction), depth 1 first."""
    return [f"mtp_loss/depth{k}" for k in range(1, model.mtp.depth + 1)]


class MTPStep:
    """The depths' losses of a step: each the mean over the pass's micro-batches of the micro-batch's loss at that
    depth, averaged over the data-parallel replicas like the language-model loss. The last stage's first
    tensor-parallel rank of each replica adds them to the loss's all-reduce (every tp rank holds the same)."""

    validates = True  # also shared by a validation pass (`mlplat.step.train_step.TrainStep.evaluate`)

    def __init__(self, chunks: dict[int, nn.Module], model_cfg: ModelConfig, grid: ParallelGrid):
        self.model_cfg, self.grid = model_cfg, grid
        self.modules = mtp_modules(chunks.values())
        self.values = model_cfg.mtp.depth
        self.losses: torch.Tensor | None = None  # the last shared step's, [D]

    def before_pass(self, loss_scale: float, micro_batches: int) -> None:
        for module in self.modules:
            module.reset_stats()

    def fill(self, values: torch.Tensor) -> None:
        if self.grid.tp_rank != 0:
            return
        for module in self.modules:
            if module.micro_batches:
                values += (module.loss_sum / module.micro_batches).to(values)

    def shared(self, values: torch.Tensor, shares: int) -> None:
        self.losses = values / shares

    def record(self) -> dict[str, Any]:
        if self.losses is None:
            return {"mtp_loss": None}
        return {"mtp_loss": dict(zip(mtp_loss_columns(self.model_cfg), self.losses.detach().cpu()))}

    def after_step(self) -> None:
        pass
