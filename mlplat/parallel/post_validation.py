"""Optimizer post-validation (`optim.post_validate=true`; Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024).

The synchronous step reads two all-reduces over the ranks before the optimizer moves: the inf/NaN flag of loss
scaling and the global gradient norm of clipping. So every rank waits for the slowest rank's gradients, and only
then runs its optimizer arithmetic. Post-validation turns this round: the two all-reduces are posted
asynchronously (`PostedChecks`), what the step writes is saved (`StepSnapshot`), and the optimizer steps at once,
on the unclipped gradients, while the all-reduces are in flight. Their results are read afterwards:
- neither applies (the common case once training settles): the step stands;
- the norm is above optim.grad_clip: the saved state comes back and the step is redone on the clipped gradients,
  which is the synchronous step's arithmetic exactly;
- an inf/NaN on any rank: the saved state comes back and the step is skipped, as the synchronous step skips it.
Every rank reads the same all-reduced values, so every rank takes the same branch.

The cost is a copy of what the step writes, on the parallel device: the weights it steps (main weights, or the
weights themselves) and Adam's two moments, this rank's shard of them (`Precision.step_state_bytes`, counted by
the memory model). A rejected step also costs a second step; the training step (`GPTModule.optimize`) runs the
step after a clipped or overflowed one synchronously, so a run of such steps costs one of them.

What this does not remove: the results are read before the training step returns, so the next step's first
forward still starts after the slowest rank's checks. The cross-step form of the paper (read them during the next
step's warm-up) also needs the gradients kept for a redo and the next pass run again after one.

No Lightning and no Hydra here.
"""
from __future__ import annotations

import torch

from mlplat.parallel.data_parallel import DataParallelGrads
from mlplat.parallel.loss_scale import DynamicLossScaler
from mlplat.parallel.main_params import MainParamsAdamW


class PostedChecks:
    """The inf/NaN flag (with a loss scaler; the gradients are unscaled in place first) and the squared gradient
    norm, their all-reduces posted, in the synchronous step's order."""

    def __init__(self, grads: DataParallelGrads, loss_scaler: DynamicLossScaler | None):
        self.found, found_work = (loss_scaler.unscale_and_flag_(grads.shard_grads(), async_op=True)
                                  if loss_scaler is not None else (None, None))
        self.sq, sq_work = grads.grad_norm_sq(async_op=True)
        self.works = [w for w in (found_work, sq_work) if w is not None]

    def wait(self) -> tuple[bool, torch.Tensor]:
        """(found_inf, norm), as `DataParallelGrads.unscale_and_clip_` gives them (norm inf on an overflow)."""
        for work in self.works:
            work.wait()
        found_inf = self.found is not None and bool(self.found.item() > 0)
        return found_inf, torch.full_like(self.sq, float("inf")) if found_inf else self.sq.sqrt()


class StepSnapshot:
    """What one optimizer step writes, copied before it: `restore()` puts it back. For `MainParamsAdamW` the
    buckets' main weights (a view of the weights' own shard when they are not separate) and moments, and its step
    count; for a torch optimizer its parameters and per-parameter state (a first step's empty state included)."""

    def __init__(self, optimizer: torch.optim.Optimizer, grads: DataParallelGrads):
        self.optimizer = optimizer
        if isinstance(optimizer, MainParamsAdamW):
            self.saved = [(t, t.clone()) for b in grads.buckets for t in (b.main, b.exp_avg, b.exp_avg_sq)]
            self.steps = optimizer.steps
        else:
            params = [p for group in optimizer.param_groups for p in group["params"]]
            self.saved = [(p.detach(), p.detach().clone()) for p in params]
            self.state = {p: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in optimizer.state[p].items()}
                          for p in params if p in optimizer.state}

    @torch.no_grad()
    def restore(self) -> None:
        """The state before the step. The model's weights follow for a torch optimizer; after `MainParamsAdamW`
        they are the step's until the caller publishes the main weights again (a redone step does, or
        `DataParallelGrads.refresh`). The step's all-gathers must have completed (`DataParallelGrads.wait`)."""
        for live, copy in self.saved:
            live.copy_(copy)
        if isinstance(self.optimizer, MainParamsAdamW):
            self.optimizer.steps = self.steps
        else:
            self.optimizer.state.clear()
            self.optimizer.state.update(self.state)  # the copies themselves: this snapshot is used once
