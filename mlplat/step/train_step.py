"""TrainStep: one PTD-P optimizer step per batch, as a plain object (a loop of `run(batch)` trains; the
LightningModule, `mlplat.lightning.module`, adapts it to Lightning).

A step is the pipeline schedule over m micro-batches (forward and backward inside it), then the gradient buffer's
reductions (`mlplat.optim.buffers.ParamBuffers`: data-parallel buckets, tied embedding, the parameters
applied to sequence-parallel shards over the tensor-parallel group), unscaling and global-norm clipping, the
optimizer and the learning-rate schedule: one path for every precision and optimizer. The loss lives on the last
pipeline stage and is shared with every rank for logging.

The optimizer is optim.name's, built by `mlplat.optim.factory` (the only place that names one). Under
optim.post_validate the step is checked after the next step's pass (`mlplat.step.post_validation`).

A step whose loss or gradient norm is inf/NaN (on any rank: both are all-reduced) is skipped and counted, with or
without loss scaling; optim.max_skipped_steps of them in a row stop training (`DivergenceError`).
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import math
from functools import partial
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from mlplat.config import RunConfig
from mlplat.errors import DivergenceError
from mlplat.lr_schedule import lr_factor
from mlplat.model import generation
from mlplat.model.attention import resolve_backend
from mlplat.model.decoder import DecoderChunk, build_rank_chunks
from mlplat.model.init import init_full_view
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
from mlplat.model.warmup import compile_fused
from mlplat.optim import factory as optimizers
from mlplat.optim.buffers import ParamBuffers, clip_coefficient
from mlplat.optim.loss_scale import DynamicLossScaler
from mlplat.optim.main_params import megatron_dtype
from mlplat.parallel.allocator import AllocatorRetries
from mlplat.parallel.grid import ParallelGrid, dist_ready
from mlplat.parallel.hang import HangWatch
from mlplat.parallel.pipeline.engine import PipelineEngine
from mlplat.parallel.pipeline.p2p import StageComm
from mlplat.parallel.placement import place
from mlplat.parallel.random import STAGE_RNG, RNGTracker, rng_states, seed_model_parallel, set_rng_states
from mlplat.parallel.sequence import sequence_parallel_replicated
from mlplat.precision import TABLE, precision_of
from mlplat.step.post_validation import PendingStep, PostedChecks, StepSnapshot
from mlplat.step.records import RECORDS_KEPT, StepRecord, moe_load_metrics

log = logging.getLogger("mlplat")
# The GEMMs' dtype of the autocast precisions: stage messages travel in it (the other precisions' weights, and so
# their activations, are already in it).
AUTOCAST_DTYPES = {n: getattr(torch, e.compute_dtype) for n, e in TABLE.items() if e.autocast}


def weight_dtype(precision: str) -> torch.dtype:
    """The dtype the chunks are built in: the table's weight dtype, fp32 under a Megatron precision (the gradient
    buffer takes those values as the main weights, then casts the weights)."""
    entry = precision_of(precision)
    return torch.float32 if entry.megatron else getattr(torch, entry.weight_dtype)


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
        self.chunks: dict[int, DecoderChunk] = self._build_chunks()
        self.moe = moe_layers(self.chunks.values())  # this rank's mixture-of-experts layers (mlplat.model.moe)
        self.aux_loss: torch.Tensor | None = None  # the last shared step's balancing loss (with MoE layers)
        # The model's MoE layers (global indices), whose load figures travel with the loss; this rank's among them.
        self.moe_ids = cfg.model.moe_layer_ids
        self.moe_held = {i: chunk.layers[str(i)].mlp for chunk in self.chunks.values() for i in chunk.layer_ids
                         if isinstance(chunk.layers[str(i)].mlp, MoELayer)}
        figures = torch.arange(len(LOAD_FIGURES))
        # where this rank's layers' figures go in the loss's all-reduce (made once: no host copy per step)
        self._load_slots = torch.cat([2 + len(LOAD_FIGURES) * self.moe_ids.index(i) + figures for i in self.moe_held]
                                     or [figures[:0]]).to(self.device)
        self.moe_load: torch.Tensor | None = None  # the last shared step's [MoE layers, LOAD_FIGURES]
        self.optimizer_entry = optimizers.get(cfg.optim.name)
        # fp16 loss scaling (16-mixed, 16-megatron); None: no scaling. Its state is in `state_dict`.
        self.loss_scaler = DynamicLossScaler() if precision_of(cfg.trainer.precision).loss_scaling else None
        self.steps = 0  # optimizer steps taken, skipped ones included (Lightning's global_step under a Trainer)
        self.found_inf = False  # the last checked loss or gradients were inf/NaN (their step is skipped)
        self.skipped_steps = 0  # optimizer steps skipped for an inf/NaN loss or gradient norm, over the run
        self.skipped_in_a_row = 0
        self.redone_steps = 0  # steps post-validation rejected (clipping or an overflow applied) and redid or skipped
        self.step_first = True  # under optim.post_validate: the next step steps before its checks are read
        self.pending: PendingStep | None = None  # a step taken before its checks were read (post-validation)
        self.records: dict[int, StepRecord] = {}  # the last settled steps' records, by step
        # Called with each record as its step is settled, before any later step moves the weights (the Lightning
        # adapter logs it).
        self.on_settle: Callable[[StepRecord], None] | None = None
        self._grads: ParamBuffers | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._schedule: torch.optim.lr_scheduler.LambdaLR | None = None
        self._engine: PipelineEngine | None = None

    # -- model ---------------------------------------------------------------------------------------
    def _build_chunks(self) -> dict[int, DecoderChunk]:
        cfg, grid = self.cfg, self.grid
        kernels_cfg = cfg.kernels
        backend = resolve_backend(kernels_cfg.attention, self.device.type, cfg.trainer.precision, grid.cp,
                                  cfg.model.head_size)
        self.attention_backend = backend
        if grid.rank == 0:
            chosen = f"{backend} (auto)" if kernels_cfg.attention == "auto" else backend
            log.info("kernels: attention=%s, fused=%s, recompute=%s", chosen, kernels_cfg.fused, kernels_cfg.recompute)
        # Built and initialised in the weights' dtype, as Lightning's precision plugins build a module: the same
        # initial weights with or without a Trainer.
        dtype, default = weight_dtype(str(cfg.trainer.precision)), torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            chunks = build_rank_chunks(cfg.model, grid, cfg.parallel.pipeline, kernels=kernels_cfg,
                                       tracker=self.tracker, backend=backend,
                                       sequence_parallel=cfg.parallel.sequence_parallel)
            for chunk in chunks.values():
                if cfg.init_from is None:
                    init_full_view(chunk, cfg.seed)
                if chunk.ring is not None:  # the ring's waits are labelled too
                    chunk.ring.watch = self.watch
        finally:
            torch.set_default_dtype(default)
        if cfg.init_from is not None:  # a transformers model directory: each rank reads only its shards
            from mlplat.checkpoint.hf import load_into

            load_into(chunks.values(), cfg.init_from, grid)
        return {c: chunk.to(device=self.device, dtype=dtype) for c, chunk in chunks.items()}

    def parameters(self) -> list[nn.Parameter]:
        return [p for chunk in self.chunks.values() for p in chunk.parameters()]

    # -- built on first use ----------------------------------------------------------------------------
    @property
    def grads(self) -> ParamBuffers:
        """The flat gradient buffer and every gradient reduction; under a Megatron precision the weights become bf16
        (fp16) here, after their fp32 values are taken as the main weights."""
        if self._grads is None:
            cfg, grid, chunks, params = self.cfg, self.grid, self.chunks, self.parameters()
            half = megatron_dtype(cfg.trainer.precision)
            current = params[0].dtype
            self._grads = ParamBuffers(
                chunks, grid, optimizers.param_groups(params), param_dtype=half or current,
                main_dtype=torch.float32 if half is not None else current, distributed=cfg.optim.distributed,
                whole_params=self.optimizer_entry.whole_matrices,
                tied=[t for c in chunks.values() for t in c.tied_parameters()],
                sequence_parallel=sequence_parallel_replicated(params),
                reduce_dtype=torch.bfloat16 if cfg.optim.grad_reduce_dtype == "bf16" else None, **self.grad_options)
        return self._grads

    @property
    def engine(self) -> PipelineEngine:
        if self._engine is None:
            grid, parallel_cfg, model_cfg = self.grid, self.cfg.parallel, self.cfg.model
            grads = self.grads  # first: it sets the weights' dtype, which the stage messages take
            first = self.parameters()[0]
            comm = None
            if grid.pp > 1:
                # With sequence parallelism the stages exchange this rank's sequence shard: already 1/t of the
                # activation, and different on each tensor-parallel rank, so there is nothing to scatter or gather.
                sp = parallel_cfg.sequence_parallel  # validation refuses it at t < 2
                seq = model_cfg.seq_len // grid.cp  # a context-parallel rank's tokens
                seq = seq // grid.tp if sp else seq
                comm = StageComm(grid, (parallel_cfg.micro_batch_size, seq, model_cfg.hidden), first.dtype,
                                 first.device, scatter_gather=parallel_cfg.scatter_gather and not sp,
                                 wire_dtype=AUTOCAST_DTYPES.get(str(self.cfg.trainer.precision)))
            self._engine = PipelineEngine(self.chunks, grid, parallel_cfg.pipeline, comm,
                                          before_backward=grads.before_backward, grad_ready=grads.grad_ready,
                                          watch=self.watch)
            if self.cfg.kernels.fused:
                self._compile_fused(comm, first.dtype)
        return self._engine

    def _compile_fused(self, comm: StageComm | None, dtype: torch.dtype) -> None:
        """Every fused operator compiled now, before any pipeline transfer is posted (mlplat.model.warmup)."""
        cfg, grid = self.cfg, self.grid
        zeros = torch.zeros(cfg.parallel.micro_batch_size, cfg.model.seq_len, dtype=torch.long, device=self.device)
        train = self._micro_batches((zeros, zeros, zeros) if cfg.data.pack else (zeros, zeros))[0]
        sample = None
        if cfg.sample.max_new_tokens > 0:
            one, _, placed = place(zeros[:1], zeros[:1, :0], cfg.model.seq_len, grid.cp, grid.cp_rank)
            sample = (one, None, placed)
        message = (comm.shape, comm.dtype) if comm is not None else ((*zeros.shape, cfg.model.hidden), dtype)
        with self.watch.blocked_in("compiling the fused operators", "compute"):
            compile_fused(self.chunks, train, sample, message, self.tracker, self.device)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        if self._optimizer is None:
            optim_cfg = self.cfg.optim
            grads = self.grads  # the weights move into the flat buckets before any optimizer sees them
            self._optimizer = optimizers.build_optimizer(optim_cfg, grads, optimizers.param_groups(self.parameters()))
            # With the optimizer: it sets the first step's learning rate.
            factor = partial(lr_factor, optim_cfg=optim_cfg, max_steps=self.cfg.trainer.max_steps)
            self._schedule = torch.optim.lr_scheduler.LambdaLR(self._optimizer, factor)
        return self._optimizer

    @property
    def schedule(self) -> torch.optim.lr_scheduler.LambdaLR:
        """The learning-rate schedule (`mlplat.lr_schedule.lr_factor`), stepped once per step that is not skipped."""
        assert self.optimizer is not None  # builds both
        return self._schedule

    # -- the pass ------------------------------------------------------------------------------------
    def _micro_batches(self, batch):
        """(token ids, labels, layout) per micro-batch: this context-parallel rank's tokens and where they sit
        (mlplat.parallel.placement.place; packed batches carry each token's document as a third element)."""
        tokens, labels, *documents = batch
        grid, mbs, s = self.grid, self.cfg.parallel.micro_batch_size, self.cfg.model.seq_len
        docs = documents[0].split(mbs) if documents else itertools.repeat(None)
        return [place(t, y, s, grid.cp, grid.cp_rank, d) for t, y, d in zip(tokens.split(mbs), labels.split(mbs), docs)]

    def _share_loss(self, loss: torch.Tensor | None, async_op: bool = False, aux: bool = True):
        """The mean loss over data-parallel replicas, on every rank (it is computed on the last stage); under
        async_op a function that waits for its all-reduce and returns it. With MoE layers and `aux`, the pass's
        balancing loss travels in the same all-reduce (each stage's layers summed, the replicas averaged) and
        lands in `aux_loss` when the loss is returned, and so do the load figures of every MoE layer
        (`mlplat.model.moe.load_figures` of the global batch, added by one rank of the layer's stage: the first
        of its tensor-, context- and data-parallel ranks, which all hold the same), in `moe_load`."""
        grid = self.grid
        # On the parallel device: NCCL reduces CUDA tensors only.
        aux = aux and self.cfg.model.moe.enabled  # every rank, also one whose stage holds only dense layers
        figures = len(LOAD_FIGURES)
        value = torch.zeros(2 + figures * len(self.moe_ids) if aux else 1, dtype=torch.float64, device=self.device)
        if loss is not None and grid.tp_rank == 0:
            value[0] += loss.detach().to(value.device, torch.float64)
        if aux:  # every rank holds its share of its stage's balancing losses (mlplat.model.moe)
            value[1] += aux_loss_of(self.moe)  # a device tensor: read on the host with the loss
        if aux and self.moe_held:
            with self.watch.blocked_in("the expert-load all-reduce", "dp_comm"):
                step_loads(self.moe, grid)  # also what the expert bias moves by after the step
            if grid.tp_rank == grid.cp_rank == grid.dp_rank == 0:
                value[self._load_slots] = load_figures(list(self.moe_held.values())).reshape(-1).to(value)
        work = None
        if dist_ready():
            work = dist.all_reduce(value, async_op=async_op)
        shares = grid.dp_cp  # each context-parallel rank's loss is its share of the mean, times c

        def shared() -> torch.Tensor:
            if work is not None and async_op:
                with self.watch.blocked_in("the loss all-reduce", "dp_comm"):
                    work.wait()
            if aux:
                self.aux_loss = value[1] / shares
                self.moe_load = value[2:].view(-1, figures)
            return value[0] / shares

        return shared if async_op else shared()

    def _pipeline_pass(self, batch):
        """Forward and backward over the m micro-batches, then the gradient reductions; the loss (last stage) or
        None."""
        engine, grads = self.engine, self.grads
        grads.begin_step()
        scale = self.loss_scaler.scale if self.loss_scaler is not None else 1.0
        # The model's randomness comes from the tracker's stage stream (checkpointed), not the default generator.
        stream = self.tracker.fork(STAGE_RNG) if STAGE_RNG in self.tracker else contextlib.nullcontext()
        micro_batches = self._micro_batches(batch)
        # The balancing losses' gradients enter each MoE layer's backward, scaled as the loss of one micro-batch.
        set_aux_loss_scale(self.moe, scale / len(micro_batches))
        with stream, self._weights_fixed():
            loss = engine.run(micro_batches, loss_scale=scale)
        with self.watch.blocked_in("the data-parallel gradient reduction", "dp_comm"):
            grads.finish()
        with self.watch.blocked_in("the tied-embedding gradient all-reduce", "dp_comm"):
            grads.reduce_tied()
        if grads.shared:  # key/value heads held by several tp ranks
            with self.watch.blocked_in("the shared key/value heads' gradient all-reduce", "tp_comm"):
                grads.reduce_shared_rows()
        with self.watch.blocked_in("the sequence-parallel gradient all-reduce", "tp_comm"):
            grads.reduce_sequence_parallel()
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
            loss = self._share_loss(loss)
        self.found_inf = overflow or not _finite(loss, norm)
        return loss, norm

    @torch.no_grad()
    def evaluate(self, batch) -> torch.Tensor:
        """The loss of `batch` without gradients and without dropout (validation): the mean over the replicas,
        float64, on every rank."""
        engine = self.engine
        with self._evaluating(), torch.no_grad(), self._weights_fixed():
            return self._share_loss(engine.run(self._micro_batches(batch), forward_only=True), aux=False)

    @contextlib.contextmanager
    def _weights_fixed(self):
        """A pipeline pass, over which the weights do not change: the FP8 casts of the weights are made at their
        first use in it and kept to its end (`mlplat.parallel.fp8.WeightCasts`), once per optimizer step. Dropped
        before (the weights may have changed since: a step, a restored or redone one, a load) and after."""
        casts = [c.weight_casts for c in self.chunks.values() if getattr(c, "weight_casts", None) is not None]
        for store in casts:
            store.clear()
        try:
            yield
        finally:
            for store in casts:
                store.clear()

    @contextlib.contextmanager
    def _evaluating(self):
        """The chunks in eval mode (no dropout), then back in the mode they were in."""
        modes = {c: chunk.training for c, chunk in self.chunks.items()}
        for chunk in self.chunks.values():
            chunk.eval()
        try:
            yield
        finally:
            for c, chunk in self.chunks.items():
                chunk.train(modes[c])

    # -- the optimizer step --------------------------------------------------------------------------
    def run(self, batch) -> list[StepRecord]:
        """One optimizer step on `batch` (the pipeline pass, the checks, the optimizer and the learning-rate
        schedule); the records of the steps settled by it, oldest first.

        Synchronous (the default): the step's own record. Under optim.post_validate the optimizer steps before the
        clipping and inf/NaN checks are read, and they are read after the next step's pipeline pass: this step's
        record comes with the next step (or at the next `settle`), and the previous step's comes with this one. A
        step the checks reject is redone (clipping) or undone (an overflow), and the pass that ran on its weights
        runs again. Clipping and overflows come in runs, so the step after one that clipped, overflowed or was
        rejected is synchronous. The weights, the optimizer and every record equal the synchronous run's."""
        self.steps += 1
        opt = self.optimizer
        rng = rng_states(self.tracker) if self.pending is not None else None
        opt.zero_grad(set_to_none=True)
        loss = self._pipeline_pass(batch)
        settled = []
        if self.pending is not None:
            record, rejected = self._settle()
            settled.append(self._settled(record))
            if rejected:  # this pass ran on the weights of a step that did not stand: again, on the settled ones
                set_rng_states(rng, self.tracker)
                opt.zero_grad(set_to_none=True)
                loss = self._pipeline_pass(batch)
        if self.cfg.optim.post_validate and self.step_first:
            self._step_first(loss)
        else:
            settled.append(self._settled(self._synchronous_step(loss)))
        if retries := self.allocator.since_last():
            log.warning("rank %d, step %d: the CUDA caching allocator retried %d allocation(s) after freeing its "
                        "cache, each a device-wide synchronize that can stall or deadlock posted pipeline transfers "
                        "(docs/gpu-nccl.md): lower the memory per device (micro-batch, recomputation, layout)",
                        self.grid.rank, self.steps, retries)
        return settled

    def _step_first(self, loss) -> None:
        """Post the checks and the loss's all-reduce, save what the step reads and writes, and step at once."""
        grads, opt = self.grads, self.optimizer
        checks = PostedChecks(grads, self.loss_scaler)
        shared = self._share_loss(loss, async_op=True)
        with self.watch.blocked_in("the optimizer step", "optimizer"):
            snapshot = StepSnapshot(opt, grads, self.schedule, self.loss_scaler)
            opt.step()
            self.found_inf = False
            self._after_step()
        self.pending = PendingStep(self.steps, checks, snapshot, shared)

    def _synchronous_step(self, loss) -> StepRecord:
        loss, norm = self._checked(loss)
        with self.watch.blocked_in("the optimizer step", "optimizer"):
            if not self.found_inf:
                self.optimizer.step()
            self._count(self.steps)
            self._after_step()
        if self.cfg.optim.post_validate:  # after a clipped or overflowed step, the next is synchronous too
            self.step_first = not (self.found_inf or clip_coefficient(float(norm), self.cfg.optim.grad_clip) < 1.0)
        return self._record(self.steps, loss, norm, eager=False)

    def _settle(self) -> tuple[StepRecord, bool]:
        """(record, rejected) of the pending step: its checks read, and the step redone or undone if they say so."""
        # A settle point may sit inside Lightning's inference mode (validation on a GPU): a redone step's optimizer
        # state must not become inference tensors, which the next step could not update in place.
        with torch.inference_mode(False), torch.no_grad():
            return self._settle_pending()

    def _settle_pending(self) -> tuple[StepRecord, bool]:
        pending, self.pending = self.pending, None
        with self.watch.blocked_in("the post-validation all-reduces", "dp_comm"):
            self.found_inf, norm = pending.checks.wait()
        with self.watch.blocked_in("the loss all-reduce", "dp_comm"):
            loss = pending.loss()
        # Read on the host now, while nothing else is queued: the record needs no device sync later.
        loss, norm = loss.detach().cpu(), norm.detach().cpu()
        self.found_inf = self.found_inf or not _finite(loss, norm)
        coef = 1.0 if self.found_inf else clip_coefficient(float(norm), self.cfg.optim.grad_clip)
        rejected = self.found_inf or coef < 1.0
        if rejected:
            grads = self.grads
            with self.watch.blocked_in("the optimizer step", "optimizer"):
                self.redone_steps += 1
                grads.wait()  # the rejected step's all-gathers
                pending.snapshot.restore()
                if self.found_inf:
                    grads.refresh()  # the weights from the restored main weights
                else:
                    grads.scale_grads_(coef)
                    pending.snapshot.optimizer.step()
                self._count(pending.step)
                self._after_step()
        else:
            self._count(pending.step)
        self.step_first = not rejected
        return self._record(pending.step, loss, norm, eager=True), rejected

    def settle(self) -> StepRecord | None:
        """Settle the step taken before its checks were read, if there is one (every rank at the same point: before
        validation, a checkpoint, generation, the end of training); its record."""
        if self.pending is None:
            return None
        record, _ = self._settle()
        return self._settled(record)

    def finish(self) -> None:
        """Settle the last step and wait for its all-gathers: no collective left in flight at teardown."""
        self.settle()
        if self._grads is not None:
            self._grads.wait()

    def _count(self, step: int) -> None:
        """Count a settled step as skipped (an inf/NaN loss or norm: every rank read the same all-reduced values, so
        all skip together) or as standing; optim.max_skipped_steps skipped in a row stop training."""
        if not self.found_inf:
            self.skipped_in_a_row = 0
            return
        self.skipped_steps += 1
        self.skipped_in_a_row += 1
        limit, scaler = self.cfg.optim.max_skipped_steps, self.loss_scaler
        if self.grid.rank == 0:
            scale = (f" at loss scale {scaler.scale:g}, scale -> "
                     f"{max(scaler.min_scale, scaler.scale * scaler.backoff_factor):g}" if scaler is not None else "")
            log.warning("step %d: inf/NaN loss or gradients%s; optimizer step skipped (%d in a row, at most %d)",
                        step, scale, self.skipped_in_a_row, limit)
        if self.skipped_in_a_row >= limit:
            raise DivergenceError(f"step {step}: the loss or the gradient norm was inf/NaN at {self.skipped_in_a_row} "
                                  f"steps in a row (optim.max_skipped_steps={limit}): training stopped")

    def _after_step(self) -> None:
        if self.loss_scaler is not None:
            self.loss_scaler.update(self.found_inf)
        if not self.found_inf:
            self.schedule.step()  # a skipped step does not advance the learning-rate schedule (as in Megatron)
            update_biases(self.moe, self.grid)  # aux-loss-free balancing: the expert bias follows the step's loads

    def _record(self, step: int, loss, norm, eager: bool) -> StepRecord:
        scaler, post = self.loss_scaler, self.cfg.optim.post_validate
        return StepRecord(step, loss.detach().cpu(), norm.detach().cpu(), self.schedule.get_last_lr()[0], eager,
                          scaler.scale if scaler is not None else None,
                          self.skipped_steps if scaler is not None or self.skipped_steps else None,
                          self.redone_steps if post else None,
                          self.aux_loss.detach().cpu() if self.aux_loss is not None else None,
                          moe_load_metrics(self.moe_load.cpu(), self.cfg.model)
                          if self.moe_load is not None else None)

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
        return {"steps": self.steps, "redone_steps": self.redone_steps, "skipped_steps": self.skipped_steps,
                "skipped_in_a_row": self.skipped_in_a_row,
                "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler is not None else None}

    def load_state_dict(self, state: dict) -> None:
        self.steps, self.redone_steps = state["steps"], state.get("redone_steps", 0)
        self.skipped_steps, self.skipped_in_a_row = state.get("skipped_steps", 0), state.get("skipped_in_a_row", 0)
        if self.loss_scaler is not None and state.get("loss_scaler") is not None:
            self.loss_scaler.load_state_dict(state["loss_scaler"])

    # -- generation ----------------------------------------------------------------------------------
    def generate(self, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int = 0) -> list[int]:
        """Decoding through the pipeline (`mlplat.model.generation`): every rank takes part and returns the
        same tokens."""
        engine = self.engine
        self.settle()
        with self._evaluating(), self._weights_fixed():
            return generation.generate(engine, self.cfg.model, prompt_ids, max_new_tokens, temperature, top_k,
                                       top_p, seed, device=self.parameters()[0].device)


def _finite(loss: torch.Tensor, norm: torch.Tensor) -> bool:
    """Both on the host: the record reads them there anyway."""
    return math.isfinite(float(loss)) and math.isfinite(float(norm))
