"""A mixture of experts' part in each training step (`MoEStep`, a `mlplat.step.hooks.StepHook`), and the names of
the expert-load figures a run logs (`moe_load_columns`, `moe_load_metrics`). The layer's arithmetic is
`mlplat.model.moe`'s; this is its bookkeeping over a step."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from mlplat.config import ModelConfig
from mlplat.model.moe import (
    LOAD_FIGURES,
    MoELayer,
    aux_loss_of,
    load_figures,
    moe_layers,
    set_aux_loss_scale,
    step_loads,
    update_biases,
)
from mlplat.parallel.grid import ParallelGrid
from mlplat.parallel.hang import HangWatch

# Per MoE layer i: `moe_load_min/layer<i>`, `moe_load_max/layer<i>` and, under capacity, `moe_dropped/layer<i>`.
LAYER_LOAD = ("moe_load_min", "moe_load_max", "moe_dropped")  # LOAD_FIGURES, in its order


class MoEStep:
    """The balancing losses and the expert loads of this rank's MoE layers over a step.

    Before the pass, the balancing losses' gradient scale (the language-model loss's per micro-batch) and fresh
    statistics. In the loss's all-reduce: the pass's balancing loss (each stage's layers summed, the replicas
    averaged: `aux_loss`) and the load figures of every MoE layer of the model (`load_figures` of the global batch,
    added by one rank of the layer's stage: the first of its tensor-, context- and data-parallel ranks, which all
    hold the same: `load`, [MoE layers, LOAD_FIGURES]).

    After a step that stands, aux-loss-free balancing moves each expert's bias by the step's loads. torchtitan does
    this in an optimizer pre-step hook; here it is the step's `after_step`, called where the step advances the
    learning-rate schedule: only the step knows whether a step stands (one skipped for an inf/NaN on any rank moves
    neither), the loads were reduced with the loss (`fill`), and the optimizer factory stays free of any model
    part."""

    def __init__(self, chunks: dict[int, nn.Module], model_cfg: ModelConfig, grid: ParallelGrid,
                 device: torch.device, watch: HangWatch):
        self.model_cfg, self.grid, self.watch = model_cfg, grid, watch
        self.layers = moe_layers(chunks.values())
        ids = model_cfg.moe_layer_ids  # the model's MoE layers (global indices); this rank's among them:
        layers = {i: layer for chunk in chunks.values() for i, layer in
                  [*((i, chunk.layers[str(i)]) for i in chunk.layer_ids),  # and the modules', l + k - 1
                   *((model_cfg.n_layers + k, m.layer) for k, m in enumerate(getattr(chunk, "mtp", None) or ()))]}
        self.held = {i: layer.mlp for i, layer in layers.items() if isinstance(layer.mlp, MoELayer)}
        figures = torch.arange(len(LOAD_FIGURES))
        self.values = 1 + len(LOAD_FIGURES) * len(ids)  # the balancing loss, then each layer's figures
        # where this rank's layers' figures go (made once: no host copy per step)
        self._slots = torch.cat([1 + len(LOAD_FIGURES) * ids.index(i) + figures for i in self.held]
                                or [figures[:0]]).to(device)
        self.aux_loss: torch.Tensor | None = None  # the last shared step's
        self.load: torch.Tensor | None = None

    def before_pass(self, loss_scale: float, micro_batches: int) -> None:
        # The balancing losses' gradients enter each layer's backward, scaled as the loss of one micro-batch.
        set_aux_loss_scale(self.layers, loss_scale / micro_batches)

    def fill(self, values: torch.Tensor) -> None:
        values[0] += aux_loss_of(self.layers)  # a device tensor: read on the host with the loss
        if self.held:
            with self.watch.blocked_in("the expert-load all-reduce", "dp_comm"):
                step_loads(self.layers, self.grid)  # also what the expert bias moves by after the step
            grid = self.grid
            if grid.tp_rank == grid.cp_rank == grid.dp_rank == 0:
                values[self._slots] = load_figures(list(self.held.values())).reshape(-1).to(values)

    def shared(self, values: torch.Tensor, shares: int) -> None:
        self.aux_loss = values[0] / shares
        self.load = values[1:].view(-1, len(LOAD_FIGURES))

    def record(self) -> dict[str, Any]:
        return {"moe_aux_loss": self.aux_loss.detach().cpu() if self.aux_loss is not None else None,
                "moe_load": moe_load_metrics(self.load.cpu(), self.model_cfg) if self.load is not None else None}

    def after_step(self) -> None:
        update_biases(self.layers, self.grid)  # aux-loss-free balancing: the expert bias follows the step's loads


def _load_names(model: ModelConfig) -> tuple[str, ...]:
    return LAYER_LOAD if model.moe.capacity_factor is not None else LAYER_LOAD[:2]  # dropless: nothing dropped


def moe_load_columns(model: ModelConfig) -> list[str]:
    """The load figures' names ([] for a dense model): over the layers (the least loaded expert's share of the mean
    in any layer, the most loaded's, the dropped fraction over all layers), then per layer. The dropped fractions
    under capacity_factor only."""
    names = _load_names(model) if model.moe.enabled else ()
    return [*names, *(f"{name}/layer{i}" for i in model.moe_layer_ids for name in names)]


def moe_load_metrics(figures: torch.Tensor, model: ModelConfig) -> dict[str, torch.Tensor]:
    """`moe_load_columns` -> value, from the step's [MoE layers, 3] figures (`load_figures`). Every layer has as
    many assignments, so the dropped fraction over all layers is the layers' mean."""
    k = len(_load_names(model))
    overall = torch.stack([figures[:, 0].min(), figures[:, 1].max(), figures[:, 2].mean()])[:k]
    return dict(zip(moe_load_columns(model), [*overall, *figures[:, :k].reshape(-1)]))
