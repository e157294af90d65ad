"""What a settled optimizer step logs (`StepRecord`), under metrics.csv's and the loggers' names."""
from __future__ import annotations

from dataclasses import dataclass

import torch

RECORDS_KEPT = 8  # settled steps' records kept for the callbacks (metrics.csv writes a step's row one step later)
RECORD_METRICS = ("train_loss", "grad_norm", "lr", "loss_scale", "skipped_steps", "redone_steps", "moe_aux_loss",
                  "qk_clipped_heads")


@dataclass
class StepRecord:
    """One optimizer step's logged figures, known once the step is settled: at once for a synchronous step, after
    the next step's pipeline pass (or at a settle point) for one stepped before its checks (post-validation)."""

    step: int  # optimizer steps taken, this one included (Lightning's global_step)
    loss: torch.Tensor  # the mean loss over the data-parallel replicas, on every rank (on the host)
    grad_norm: torch.Tensor  # before clipping; inf when the gradients overflowed (on the host)
    lr: float  # the learning rate after the step (the next step's)
    eager: bool  # stepped before its checks were read
    loss_scale: float | None = None  # fp16's dynamic loss scaling, after the step
    skipped_steps: int | None = None
    redone_steps: int | None = None  # under optim.post_validate: steps redone or undone so far
    # with MoE layers: the balancing losses added to train_loss's gradient (their weighted sum over layers, each
    # layer's mean over micro-batches, averaged over the replicas; mlplat.model.moe), on the host
    moe_aux_loss: torch.Tensor | None = None
    # with MoE layers: the expert load figures (`mlplat.model.moe_step.moe_load_metrics`: name -> float64
    # tensor, on the host)
    moe_load: dict[str, torch.Tensor] | None = None
    # with multi-token prediction: each depth's loss, added to train_loss's gradient (`mlplat.model.mtp_step`:
    # mtp_loss/depth<k> -> float64 tensor, on the host)
    mtp_loss: dict[str, torch.Tensor] | None = None
    # under optim.muon.qk_clip: the heads of the model whose largest logit over the step exceeded it, each clipped
    # (`mlplat.model.qk_clip`), on the host
    qk_clipped_heads: torch.Tensor | None = None

    def metrics(self) -> dict[str, torch.Tensor | float]:
        """What is logged, under metrics.csv's and the loggers' names (RECORD_METRICS), in the dtypes computed."""
        values = (self.loss, self.grad_norm, self.lr, self.loss_scale, self.skipped_steps, self.redone_steps,
                  self.moe_aux_loss, self.qk_clipped_heads)
        return {**{name: v for name, v in zip(RECORD_METRICS, values) if v is not None}, **(self.moe_load or {}),
                **(self.mtp_loss or {})}
