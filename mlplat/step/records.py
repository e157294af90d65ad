"""What a settled optimizer step logs (`StepRecord`), under metrics.csv's and the loggers' names."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from mlplat.config import ModelConfig

RECORDS_KEPT = 8  # settled steps' records kept for the callbacks (metrics.csv writes a step's row one step later)
RECORD_METRICS = ("train_loss", "grad_norm", "lr", "loss_scale", "skipped_steps", "redone_steps", "moe_aux_loss")
# Per MoE layer i: `moe_load_min/layer<i>`, `moe_load_max/layer<i>` and, under capacity, `moe_dropped/layer<i>`.
LAYER_LOAD = ("moe_load_min", "moe_load_max", "moe_dropped")  # mlplat.model.moe.LOAD_FIGURES, in its order


def _load_names(model: ModelConfig) -> tuple[str, ...]:
    return LAYER_LOAD if model.moe.capacity_factor is not None else LAYER_LOAD[:2]  # dropless: nothing dropped


def moe_load_columns(model: ModelConfig) -> list[str]:
    """The load figures' names ([] for a dense model): over the layers (the least loaded expert's share of the mean
    in any layer, the most loaded's, the dropped fraction over all layers), then per layer. The dropped fractions
    under capacity_factor only."""
    names = _load_names(model) if model.moe.enabled else ()
    return [*names, *(f"{name}/layer{i}" for i in model.moe_layer_ids for name in names)]


def moe_load_metrics(figures: torch.Tensor, model: ModelConfig) -> dict[str, torch.Tensor]:
    """`moe_load_columns` -> value, from the step's [MoE layers, 3] figures (mlplat.model.moe.load_figures). Every
    layer has as many assignments, so the dropped fraction over all layers is the layers' mean."""
    k = len(_load_names(model))
    overall = torch.stack([figures[:, 0].min(), figures[:, 1].max(), figures[:, 2].mean()])[:k]
    return dict(zip(moe_load_columns(model), [*overall, *figures[:, :k].reshape(-1)]))


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
    # with MoE layers: the expert load figures (`moe_load_metrics`: name -> float64 tensor, on the host)
    moe_load: dict[str, torch.Tensor] | None = None

    def metrics(self) -> dict[str, torch.Tensor | float]:
        """What is logged, under metrics.csv's and the loggers' names (RECORD_METRICS), in the dtypes computed."""
        values = (self.loss, self.grad_norm, self.lr, self.loss_scale, self.skipped_steps, self.redone_steps,
                  self.moe_aux_loss)
        return {**{name: v for name, v in zip(RECORD_METRICS, values) if v is not None}, **(self.moe_load or {})}
