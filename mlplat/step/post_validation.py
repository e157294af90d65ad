"""Optimizer post-validation (`optim.post_validate=true`; Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024).

The synchronous step reads two all-reduces over the ranks before the optimizer moves: the inf/NaN flag of loss
scaling and the global gradient norm of clipping. So every rank waits for the slowest rank's gradients, and no rank
starts the next step's first forward before the last rank has finished this step's last backward: a pipeline whose
ranks finish a step at different times (ZB-V, ZB-H2: rank r starts r forwards late) idles at every step boundary.

Post-validation turns this round and carries the checks across the step boundary:
- at the end of step k the two all-reduces and the loss's are posted asynchronously (`PostedChecks`), what the step
  reads and writes is saved (`StepSnapshot`), and the optimizer steps at once on the unclipped gradients;
- step k+1's pipeline pass starts right away, on the weights step k gave, with nothing global in between: each rank
  goes on as soon as its own step is done, so the next step's head fills the last one's tail;
- after that pass the checks of step k are read (`PendingStep`; they completed long before). Neither applies (the
  common case once training settles): step k stands. The norm is above optim.grad_clip: step k is redone from the
  saved state on its clipped gradients, the synchronous step's arithmetic exactly. An inf/NaN on any rank: step k is
  undone and skipped, as the synchronous step skips it. Either way step k+1's pass ran on weights that did not stand:
  it runs again, from the same RNG state, on the settled weights.
Every rank reads the same all-reduced values at the same point of its step, so every rank takes the same branch.
A step is also settled wherever its state is read before another pass runs: validation, a checkpoint, generation,
the end of training (`TrainStep.settle`). `step_first` and `settle` below run this for `TrainStep.run`.

The cost is a copy, on the parallel device, of what a step reads and writes: its gradients, the weights it steps
(main weights, or the weights themselves) and Adam's two moments, this rank's shard of them
(`Precision.step_state_bytes`, counted by the memory model). A rejected step costs a second optimizer step and a
second pipeline pass; clipping and overflows come in runs, so the training step (`TrainStep.run`) takes the
step after a rejected, clipped or overflowed one synchronously, and a run of them costs one rejection.

No Lightning and no Hydra here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from mlplat.optim.buffers import ParamBuffers, clip_coefficient
from mlplat.optim.factory import state_names
from mlplat.optim.loss_scale import DynamicLossScaler
from mlplat.optim.main_params import MainParamsOptimizer
from mlplat.step.records import StepRecord
from mlplat.step.skips import finite

# The training step these functions run for (`mlplat.step.train_step.TrainStep`, which imports this module): its
# gradient buffer, optimizer, schedule, loss scaler, counters and hang watch.
TrainStep = Any


class PostedChecks:
    """The inf/NaN flag (with a loss scaler; the gradients are unscaled in place first) and the squared gradient
    norm, their all-reduces posted, in the synchronous step's order."""

    def __init__(self, grads: ParamBuffers, loss_scaler: DynamicLossScaler | None):
        self.found, found_work = (loss_scaler.unscale_and_flag_(grads.shard_grads(), async_op=True)
                                  if loss_scaler is not None else (None, None))
        self.sq, sq_work = grads.grad_norm_sq(async_op=True)
        self.works = [w for w in (found_work, sq_work) if w is not None]

    def wait(self) -> tuple[bool, torch.Tensor]:
        """(found_inf, norm), as `ParamBuffers.unscale_and_clip_` gives them (norm inf on an overflow)."""
        for work in self.works:
            work.wait()
        found_inf = self.found is not None and bool(self.found.item() > 0)
        return found_inf, torch.full_like(self.sq, float("inf")) if found_inf else self.sq.sqrt()


class StepSnapshot:
    """What one optimizer step reads and writes, copied before it: `restore()` puts it back. The gradients it reads
    (this rank's shards, unscaled, not clipped); for an optimizer on the main weights (`MainParamsOptimizer`) the
    buckets' main weights (a view of the weights' own shard when they are not separate) and its state (`STATE`),
    and its step count; for a torch optimizer its
    parameters and per-parameter state (a first step's empty state included); the learning-rate schedule and the
    loss scaler, which the step advances."""

    def __init__(self, optimizer: torch.optim.Optimizer, grads: ParamBuffers, schedule: Any = None,
                 loss_scaler: DynamicLossScaler | None = None):
        self.optimizer, self.grads, self.schedule, self.loss_scaler = optimizer, grads, schedule, loss_scaler
        self.gradients = [(g, g.clone()) for g in grads.shard_grads()]
        if isinstance(optimizer, MainParamsOptimizer):
            kept = state_names(optimizer)
            self.saved = [(t, t.clone()) for b in grads.buckets for t in (b.main, *(b.state[k] for k in kept))]
            self.steps = optimizer.steps
        else:
            params = [p for group in optimizer.param_groups for p in group["params"]]
            self.saved = [(p.detach(), p.detach().clone()) for p in params]
            self.state = {p: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in optimizer.state[p].items()}
                          for p in params if p in optimizer.state}
        self.lrs = [group["lr"] for group in optimizer.param_groups]
        self.schedule_state = schedule.state_dict() if schedule is not None else None
        self.scaler_state = loss_scaler.state_dict() if loss_scaler is not None else None

    @torch.no_grad()
    def restore(self) -> None:
        """The state before the step, its gradients back in the buffer. The model's weights follow for a torch
        optimizer; after a `MainParamsOptimizer` they are the step's until the caller publishes the main weights again
        (a redone step does, or `ParamBuffers.refresh`). The step's all-gathers must have completed
        (`ParamBuffers.wait`)."""
        for live, copy in self.saved + self.gradients:
            live.copy_(copy)
        self.grads.expose()  # the optimizer reads them through p.grad, which may have been dropped since
        if isinstance(self.optimizer, MainParamsOptimizer):
            self.optimizer.steps = self.steps
        else:
            self.optimizer.state.clear()
            self.optimizer.state.update(self.state)  # the copies themselves: this snapshot is used once
        for group, lr in zip(self.optimizer.param_groups, self.lrs):
            group["lr"] = lr
        if self.schedule is not None:
            self.schedule.load_state_dict(self.schedule_state)
        if self.loss_scaler is not None:
            self.loss_scaler.load_state_dict(self.scaler_state)


@dataclass
class PendingStep:
    """A step taken before its checks were read: what settling it needs. `loss` waits for the loss's all-reduce and
    returns it; the snapshot holds the optimizer, the schedule and the loss scaler, for a redo."""

    step: int
    checks: PostedChecks
    snapshot: StepSnapshot
    loss: Callable[[], torch.Tensor]


def step_first(step: TrainStep, loss: torch.Tensor | None) -> None:
    """Post the checks and the loss's all-reduce, save what the step reads and writes, and step at once."""
    grads, opt = step.grads, step.optimizer
    checks = PostedChecks(grads, step.loss_scaler)
    shared = step.share_loss(loss, async_op=True)
    with step.watch.blocked_in("the optimizer step", "optimizer"):
        snapshot = StepSnapshot(opt, grads, step.schedule, step.loss_scaler)
        opt.step()
        step.found_inf = False
        step.after_step()
    step.pending = PendingStep(step.steps, checks, snapshot, shared)


def settle(step: TrainStep) -> tuple[StepRecord, bool]:
    """(record, rejected) of the pending step: its checks read, and the step redone or undone if they say so."""
    # A settle point may sit inside Lightning's inference mode (validation on a GPU): a redone step's optimizer
    # state must not become inference tensors, which the next step could not update in place.
    with torch.inference_mode(False), torch.no_grad():
        pending, step.pending = step.pending, None
        with step.watch.blocked_in("the post-validation all-reduces", "dp_comm"):
            step.found_inf, norm = pending.checks.wait()
        with step.watch.blocked_in("the loss all-reduce", "dp_comm"):
            loss = pending.loss()
        # Read on the host now, while nothing else is queued: the record needs no device sync later.
        loss, norm = loss.detach().cpu(), norm.detach().cpu()
        step.found_inf = step.found_inf or not finite(loss, norm)
        coef = 1.0 if step.found_inf else clip_coefficient(float(norm), step.cfg.optim.grad_clip)
        rejected = step.found_inf or coef < 1.0
        if rejected:
            grads = step.grads
            with step.watch.blocked_in("the optimizer step", "optimizer"):
                step.redone_steps += 1
                grads.wait()  # the rejected step's all-gathers
                pending.snapshot.restore()
                if step.found_inf:
                    grads.refresh()  # the weights from the restored main weights
                else:
                    grads.scale_grads_(coef)
                    pending.snapshot.optimizer.step()
                step.skips.count(pending.step, step.found_inf, step.loss_scaler)
                step.after_step()
        else:
            step.skips.count(pending.step, step.found_inf, step.loss_scaler)
        step.step_first = not rejected
        return step.record(pending.step, loss, norm, eager=True), rejected
