"""What a part of the model that takes part in every training step gives `TrainStep` (`StepHook`), so that the step
itself knows no such part: a mixture of experts' balancing losses, load figures and expert-bias update
(`mlplat.model.moe_step.MoEStep`) are one. The model supplies its hooks (`mlplat.model.builder.step_hooks`); their
values travel in the loss's all-reduce (`share_loss`)."""
from __future__ import annotations

from typing import Any, Protocol, Sequence

import torch
import torch.distributed as dist

from mlplat.parallel.grid import ParallelGrid, dist_ready
from mlplat.parallel.hang import HangWatch


class StepHook(Protocol):
    """Called by the training step, in this order, at each step: `before_pass` before the pipeline pass; `fill` its
    `values` slots of the loss's float64 all-reduce (zeros, summed over every rank: all ranks hold the same hooks)
    and `shared` them when the loss is read (the pass's figures are known then); `record` the fields it adds to the
    step's `StepRecord`; `after_step` once a step stands (not after a skipped one; again after a redone one). A hook
    whose `validates` is true (class attribute; absent: false) takes part in a validation pass the same way, from
    `before_pass` to `record` (its figures then the validation's)."""

    values: int  # the float64 values it adds to the loss's all-reduce

    def before_pass(self, loss_scale: float, micro_batches: int) -> None: ...

    def fill(self, values: torch.Tensor) -> None: ...

    def shared(self, values: torch.Tensor, shares: int) -> None: ...

    def record(self) -> dict[str, Any]: ...

    def after_step(self) -> None: ...


def share_loss(loss: torch.Tensor | None, grid: ParallelGrid, device: torch.device, hooks: Sequence[StepHook],
               watch: HangWatch, async_op: bool = False):
    """The mean loss over data-parallel replicas, on every rank (it is computed on the last stage); under async_op
    a function that waits for its all-reduce and returns it. The hooks' values travel in the same all-reduce and
    are handed back to them when the loss is returned."""
    # On the parallel device: NCCL reduces CUDA tensors only.
    value = torch.zeros(1 + sum(h.values for h in hooks), dtype=torch.float64, device=device)
    if loss is not None and grid.tp_rank == 0:
        value[0] += loss.detach().to(value.device, torch.float64)
    slices = value[1:].split([h.values for h in hooks])
    for hook, part in zip(hooks, slices):
        hook.fill(part)
    work = dist.all_reduce(value, async_op=async_op) if dist_ready() else None
    shares = grid.dp_cp  # each context-parallel rank's loss is its share of the mean, times c

    def shared() -> torch.Tensor:
        if work is not None and async_op:
            with watch.blocked_in("the loss all-reduce", "dp_comm"):
                work.wait()
        for hook, part in zip(hooks, slices):
            hook.shared(part, shares)
        return value[0] / shares

    return shared if async_op else shared()
