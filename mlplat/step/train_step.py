"""TrainStep: one PTD-P optimizer step per batch, as a plain object (a loop of `run(batch)` trains; the
LightningModule, `mlplat.lightning.module`, adapts it to Lightning).

A step is the pipeline schedule over m micro-batches (forward and backward inside it), the gradient buffer's
reductions (`mlplat.optim.buffers.ParamBuffers`), unscaling and global-norm clipping, the optimizer and the
learning-rate schedule: one path for every precision and optimizer. The loss lives on the last pipeline stage and is
shared with every rank for logging. The step only steps: the model comes from `mlplat.model.builder`, the
optimizer from `mlplat.optim.factory` (optim.name), what a part of the model does at each step (a mixture of
experts' balancing) from step hooks (`mlplat.step.hooks`); under optim.post_validate the step is checked after the
next step's pass (`mlplat.step.post_validation`); a step whose loss or gradient norm is inf/NaN on any rank is
skipped and counted (`mlplat.step.skips`).
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.nn as nn

from mlplat.checkpoint.hf import load_into
from mlplat.config import RunConfig
from mlplat.lr_schedule import CosineSchedule
from mlplat.model.builder import build_model, eval_mode, step_hooks, weights_fixed
from mlplat.optim import factory as optimizers
from mlplat.optim.buffers import ParamBuffers, clip_coefficient
from mlplat.optim.loss_scale import DynamicLossScaler
from mlplat.parallel.allocator import AllocatorRetries
from mlplat.parallel.fp8_verdicts import decide_fp8_kernels, world_min
from mlplat.parallel.grid import ParallelGrid
from mlplat.parallel.hang import HangWatch
from mlplat.parallel.pipeline.engine import PipelineEngine
from mlplat.parallel.random import STAGE_RNG, RNGTracker, rng_states, seed_model_parallel, set_rng_states
from mlplat.precision import precision_of
from mlplat.step import post_validation
from mlplat.step.hooks import StepHook, share_loss
from mlplat.step.parts import build_engine, build_grads, micro_batches, reduce_grads
from mlplat.step.records import RECORDS_KEPT, StepRecord
from mlplat.step.skips import SkippedSteps, finite


class TrainStep:
    """This rank's part of the model and of its training: built from the config, the grid and the device.

    `run(batch)` takes one optimizer step and returns the records it settled; `settle()` settles a step taken
    before its checks; `evaluate(batch)` is the validation loss, `forward_backward(batch)` the gradients alone;
    `chunks`, `optimizer`, `tracker` and `state_dict()` are what a checkpoint saves. The gradient buffer, the
    optimizer, the schedule and the engine are built on first use, so the chunks may still be converted (dtype,
    device) after construction. `grad_options` go to `ParamBuffers` (bucket_bytes, overlap)."""

    def __init__(self, cfg: RunConfig, grid: ParallelGrid, device: torch.device | str | None = None,
                 **grad_options):
        self.cfg, self.grid, self.grad_options = cfg, grid, grad_options
        self.device = torch.device(device or "cpu")  # every tensor the step shares with other ranks lives here
        self.tracker = RNGTracker()
        seed_model_parallel(cfg.seed, grid, self.tracker)
        # A rank stuck past parallel.timeout_s (a dead or stalled peer) logs where and exits (parallel/hang.py);
        # the same labels are the spans of profiled steps.
        self.watch = HangWatch(grid, cfg.parallel.timeout_s)
        self.watch.allocator = self.allocator = AllocatorRetries(self.device)
        self.chunks, self.attention_backend = build_model(cfg, grid, self.device, self.tracker, self.watch,
                                                          read_init=load_into)
        self.hooks: list[StepHook] = step_hooks(cfg, self.chunks, grid, self.device, self.watch)
        # kernels.fp8's probed kernels: decided and agreed by every rank here, never inside a pass (fp8_verdicts)
        decide_fp8_kernels(cfg.kernels.fp8, str(cfg.trainer.precision), cfg.model.moe.enabled, self.device,
                           world_min(self.device))
        self.optimizer_entry = optimizers.get(cfg.optim.name)
        # fp16 loss scaling (16-mixed, 16-megatron); None: no scaling. Its state is in `state_dict`.
        self.loss_scaler = DynamicLossScaler() if precision_of(cfg.trainer.precision).loss_scaling else None
        self.steps = 0  # optimizer steps taken, skipped ones included (Lightning's global_step under a Trainer)
        self.found_inf = False  # the last checked loss or gradients were inf/NaN (their step is skipped)
        self.skips = SkippedSteps(cfg.optim.max_skipped_steps, grid.rank)  # for an inf/NaN loss or gradient norm
        self.redone_steps = 0  # steps post-validation rejected (clipping or an overflow applied) and redid or skipped
        self.step_first = True  # under optim.post_validate: the next step steps before its checks are read
        self.pending: post_validation.PendingStep | None = None  # stepped before its checks were read
        self.records: dict[int, StepRecord] = {}  # the last settled steps' records, by step
        self.validation_figures: dict = {}  # the validating hooks' figures of the last `evaluate`
        # Called with each record as its step settles, before a later step moves the weights (Lightning logs it).
        self.on_settle: Callable[[StepRecord], None] | None = None
        self._grads: ParamBuffers | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._schedule: CosineSchedule | None = None
        self._engine: PipelineEngine | None = None

    def parameters(self) -> list[nn.Parameter]:
        return [p for chunk in self.chunks.values() for p in chunk.parameters()]

    # -- built on first use ----------------------------------------------------------------------------
    @property
    def grads(self) -> ParamBuffers:
        if self._grads is None:
            entry = self.optimizer_entry
            self._grads = build_grads(self.cfg, self.grid, self.chunks, entry.whole_matrices, entry.work,
                                      **self.grad_options)
        return self._grads

    @property
    def engine(self) -> PipelineEngine:
        if self._engine is None:
            grads = self.grads  # first: it sets the weights' dtype, which the stage messages take
            self._engine = build_engine(self.cfg, self.grid, self.chunks, grads, self.watch, self.tracker,
                                        self.device)
        return self._engine

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        if self._optimizer is None:
            grads = self.grads  # the weights move into the flat buckets before any optimizer sees them
            self._optimizer = optimizers.build_optimizer(self.cfg.optim, grads,
                                                         optimizers.param_groups(self.parameters()))
            # With the optimizer: it sets the first step's learning rate.
            self._schedule = CosineSchedule(self._optimizer, self.cfg.optim, self.cfg.trainer.max_steps, self.grid.rank)
        return self._optimizer

    @property
    def schedule(self) -> CosineSchedule:
        """The learning-rate schedule (`mlplat.lr_schedule`), stepped once per step that is not skipped."""
        assert self.optimizer is not None  # builds both
        return self._schedule

    # -- the pass ------------------------------------------------------------------------------------
    def share_loss(self, loss: torch.Tensor | None, async_op: bool = False, hooks: bool = True):
        """The mean loss over data-parallel replicas, on every rank, with the step hooks' values (`hooks`);
        under async_op a function that waits for it (`mlplat.step.hooks.share_loss`)."""
        return share_loss(loss, self.grid, self.device, self.hooks if hooks else [], self.watch, async_op)

    def _pipeline_pass(self, batch):
        """Forward and backward over the m micro-batches, then the gradient reductions; the loss (last stage) or
        None."""
        engine, grads = self.engine, self.grads
        grads.begin_step()
        scale = self.loss_scaler.scale if self.loss_scaler is not None else 1.0
        # The model's randomness comes from the tracker's stage stream (checkpointed), not the default generator.
        stream = self.tracker.fork(STAGE_RNG) if STAGE_RNG in self.tracker else contextlib.nullcontext()
        batches = micro_batches(self.cfg, self.grid, batch)
        for hook in self.hooks:
            hook.before_pass(scale, len(batches))
        with stream, weights_fixed(self.chunks.values()):
            loss = engine.run(batches, loss_scale=scale)
        reduce_grads(grads, self.watch)
        return loss

    def forward_backward(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """The gradients of `batch` without an optimizer step: the pipeline pass, the reductions, unscaling and
        clipping; (loss, grad norm). `found_inf` says whether the loss or the gradients are inf/NaN (an overflow
        under a loss scaler: nothing is clipped and the norm is inf)."""
        return self._checked(self._pipeline_pass(batch))

    def _checked(self, loss: torch.Tensor | None):
        """(loss, norm) of a pass whose gradients are reduced: unscaled, checked and clipped, the loss shared."""
        with self.watch.blocked_in("the gradient-norm all-reduce", "dp_comm"):
            overflow, norm = self.grads.unscale_and_clip_(self.loss_scaler, self.cfg.optim.grad_clip)
        with self.watch.blocked_in("the loss all-reduce", "dp_comm"):
            loss = self.share_loss(loss)
        self.found_inf = overflow or not finite(loss, norm)
        return loss, norm

    @torch.no_grad()
    def evaluate(self, batch) -> torch.Tensor:
        """The loss of `batch` without gradients and without dropout (validation): the mean over the replicas,
        float64, on every rank. The figures of the hooks that validate (multi-token prediction's losses) are left in
        `validation_figures`."""
        engine, chunks = self.engine, self.chunks.values()
        hooks = [h for h in self.hooks if getattr(h, "validates", False)]
        batches = micro_batches(self.cfg, self.grid, batch)
        for hook in hooks:
            hook.before_pass(1.0, len(batches))
        with eval_mode(chunks), torch.no_grad(), weights_fixed(chunks):
            loss = engine.run(batches, forward_only=True)
            loss = share_loss(loss, self.grid, self.device, hooks, self.watch)
        self.validation_figures = {k: v for hook in hooks for k, v in hook.record().items()}
        return loss

    # -- the optimizer step --------------------------------------------------------------------------
    def run(self, batch) -> list[StepRecord]:
        """One optimizer step on `batch` (the pipeline pass, the checks, the optimizer and the learning-rate
        schedule); the records of the steps settled by it, oldest first: this step's own, or under
        optim.post_validate the previous step's (this one's comes with the next step or `settle`; the flow, a
        rejected step redone and the pass on its weights run again, is `mlplat.step.post_validation`'s)."""
        self.steps += 1
        opt = self.optimizer
        rng = rng_states(self.tracker) if self.pending is not None else None
        opt.zero_grad(set_to_none=True)
        loss = self._pipeline_pass(batch)
        settled = []
        if self.pending is not None:
            record, rejected = post_validation.settle(self)
            settled.append(self._settled(record))
            if rejected:  # this pass ran on the weights of a step that did not stand: again, on the settled ones
                # (autocast, whose region is the whole training step, keeps its casts of the old weights)
                torch.clear_autocast_cache()
                set_rng_states(rng, self.tracker)
                opt.zero_grad(set_to_none=True)
                loss = self._pipeline_pass(batch)
        if self.cfg.optim.post_validate and self.step_first:
            post_validation.step_first(self, loss)
        else:
            settled.append(self._settled(self._synchronous_step(loss)))
        self.allocator.warn_if_retried(self.grid.rank, self.steps)
        return settled

    def _synchronous_step(self, loss) -> StepRecord:
        loss, norm = self._checked(loss)
        with self.watch.blocked_in("the optimizer step", "optimizer"):
            if not self.found_inf:
                self.optimizer.step()
            self.skips.count(self.steps, self.found_inf, self.loss_scaler)
            self.after_step()
        if self.cfg.optim.post_validate:  # after a clipped or overflowed step, the next is synchronous too
            self.step_first = not (self.found_inf or clip_coefficient(float(norm), self.cfg.optim.grad_clip) < 1.0)
        return self.record(self.steps, loss, norm, eager=False)

    def settle(self) -> StepRecord | None:
        """Settle the step taken before its checks were read, if there is one (every rank at the same point: before
        validation, a checkpoint, generation, the end of training); its record."""
        return self._settled(post_validation.settle(self)[0]) if self.pending is not None else None

    def finish(self) -> None:
        """Settle the last step and wait for its all-gathers: no collective left in flight at teardown."""
        self.settle()
        if self._grads is not None:
            self._grads.wait()

    def after_step(self) -> None:
        if self.loss_scaler is not None:
            self.loss_scaler.update(self.found_inf)
        if not self.found_inf:
            self.schedule.step()  # a skipped step does not advance the learning-rate schedule (as in Megatron)
            for hook in self.hooks:
                hook.after_step()

    def record(self, step: int, loss, norm, eager: bool) -> StepRecord:
        scaler, skipped = self.loss_scaler, self.skips.total
        extra = {k: v for hook in self.hooks for k, v in hook.record().items()}
        return StepRecord(step, loss.detach().cpu(), norm.detach().cpu(), self.schedule.get_last_lr()[0], eager,
                          scaler.scale if scaler is not None else None,
                          skipped if scaler is not None or skipped else None,
                          self.redone_steps if self.cfg.optim.post_validate else None, **extra)

    def _settled(self, record: StepRecord) -> StepRecord:
        """A settled step's record: kept (the last RECORDS_KEPT) and passed to `on_settle`."""
        self.records[record.step] = record
        while len(self.records) > RECORDS_KEPT:
            self.records.pop(min(self.records))
        if self.on_settle is not None:
            self.on_settle(record)
        return record

    # -- checkpoints -----------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The step's own counters and the loss scaler (the weights and the optimizer go to `mlplat.checkpoint.io`
        through `chunks` and `optimizer`; the RNG streams are `tracker`'s). Settle first."""
        assert self.pending is None, "settle() before saving"
        return {"steps": self.steps, "redone_steps": self.redone_steps, "skipped_steps": self.skips.total,
                "skipped_in_a_row": self.skips.in_a_row,
                "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler is not None else None}

    def load_state_dict(self, state: dict) -> None:
        self.steps, self.redone_steps = state["steps"], state.get("redone_steps", 0)
        self.skips.total, self.skips.in_a_row = state.get("skipped_steps", 0), state.get("skipped_in_a_row", 0)
        if self.loss_scaler is not None and state.get("loss_scaler") is not None:
            self.loss_scaler.load_state_dict(state["loss_scaler"])

