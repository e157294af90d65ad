"""The LightningModule: builds this rank's model chunks from the grid and runs one PTD-P step per batch.

Manual optimisation: a step is the pipeline schedule over m micro-batches (forward and backward inside it),
then the gradient buffer's reductions (`mlplat.parallel.data_parallel.DataParallelGrads`: data-parallel buckets,
tied embedding, the parameters applied to sequence-parallel shards over the tensor-parallel group), unscaling and
global-norm clipping, the optimizer and the learning-rate schedule: one path for every precision and optimizer.
The loss lives on the last pipeline stage and is shared with every rank for logging.

The optimizer is torch's AdamW on the weights (the gradients are views of the buffer), or, for the Megatron-style
precisions (bf16-megatron, 16-megatron) and the distributed optimizer (optim.distributed=true), `MainParamsAdamW`
on the buffer's main weights (`mlplat.parallel.main_params`), sharded over the data-parallel ranks when
distributed.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
from dataclasses import dataclass
from functools import partial

import pytorch_lightning as pl
import torch
import torch.distributed as dist
import torch.nn as nn

from mlplat.config import RunConfig
from mlplat.lightning.precision import SkipsOverflowedSteps
from mlplat.lr_schedule import lr_factor
from mlplat.model import generation
from mlplat.model.attention import resolve_backend
from mlplat.model.gpt import GPTChunk, build_rank_chunks
from mlplat.model.init import init_full_view
from mlplat.model.warmup import compile_fused
from mlplat.parallel.data_parallel import DataParallelGrads, clip_coefficient
from mlplat.parallel.grid import ParallelGrid
from mlplat.parallel.hang import HangWatch
from mlplat.parallel.loss_scale import DynamicLossScaler
from mlplat.parallel.main_params import MainParamsAdamW, megatron_dtype, optimizer_state_bytes
from mlplat.parallel.pipeline.engine import PipelineEngine
from mlplat.parallel.pipeline.p2p import StageComm
from mlplat.parallel.placement import place
from mlplat.parallel.post_validation import PendingStep, PostedChecks, StepSnapshot
from mlplat.parallel.random import STAGE_RNG, RNGTracker, rng_states, seed_model_parallel, set_rng_states
from mlplat.parallel.sequence import sequence_parallel_replicated
from mlplat.precision import TABLE

log = logging.getLogger("mlplat")
# The GEMMs' dtype of Lightning's autocast precisions: stage messages travel in it (the other precisions' weights,
# and so their activations, are already in it).
AUTOCAST_DTYPES = {n: getattr(torch, e.compute_dtype) for n, e in TABLE.items() if e.autocast}
RECORDS_KEPT = 8  # settled steps' records kept for the callbacks (metrics.csv writes a step's row one step later)
RECORD_METRICS = ("train_loss", "grad_norm", "lr", "loss_scale", "skipped_steps", "redone_steps")


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

    def metrics(self) -> dict[str, torch.Tensor | float]:
        """What is logged, under metrics.csv's and the loggers' names (RECORD_METRICS), in the dtypes computed."""
        values = (self.loss, self.grad_norm, self.lr, self.loss_scale, self.skipped_steps, self.redone_steps)
        return {name: v for name, v in zip(RECORD_METRICS, values) if v is not None}


class GPTModule(pl.LightningModule):
    def __init__(self, cfg: RunConfig):
        super().__init__()
        self.cfg = cfg
        self.automatic_optimization = False
        self.chunks = nn.ModuleDict()  # str(global chunk id) -> GPTChunk held by this rank
        self.engine: PipelineEngine | None = None
        # fp16 loss scaling: taken from the LossScaledFP16Precision plugin under a Trainer (16-mixed), or set
        # directly when the module is driven without one. None = no scaling (32/64-true, bf16).
        self.loss_scaler: DynamicLossScaler | None = None
        self.found_inf = False  # the last pipeline_step's gradients overflowed (its step must be skipped)
        self.redone_steps = 0  # steps post-validation rejected (clipping or an overflow applied) and redid or skipped
        self.step_first = True  # under optim.post_validate: the next step steps before its checks are read
        self.pending: PendingStep | None = None  # a step taken before its checks were read (post-validation)
        self.records: dict[int, StepRecord] = {}  # the last settled steps' records, by step
        self._unshown: list[StepRecord] = []  # settled outside a training step: shown with the next one's
        self._local_steps = 0  # optimizer steps taken without a Trainer (else Lightning's global_step counts them)
        # Weights and gradients in flat buckets, and every gradient reduction (built once, with the optimizer or
        # the engine, whichever comes first).
        self.dp_grads: DataParallelGrads | None = None
        self.main: DataParallelGrads | None = None  # the same buffer, when the optimizer steps its main weights

    # -- model ---------------------------------------------------------------------------------------
    @property
    def grid(self):
        return self.trainer.strategy.grid

    def build(self, grid: ParallelGrid, device=None) -> None:
        """Build and initialise this rank's chunks (also usable without a Trainer)."""
        cfg = self.cfg
        self._grid = grid
        self.tracker = RNGTracker()
        seed_model_parallel(cfg.seed, grid, self.tracker)
        # A rank stuck past parallel.timeout_s (a dead or stalled peer) logs where and exits (parallel/hang.py);
        # the same labels are the spans of profiled steps.
        self.watch = HangWatch(grid, cfg.parallel.timeout_s)
        dev = torch.device(device or "cpu")
        self._device = dev  # the parallel device: every tensor the step shares with other ranks lives here
        kernels_cfg = cfg.kernels
        backend = resolve_backend(kernels_cfg.attention, dev.type, cfg.trainer.precision, grid.cp)
        self.attention_backend = backend
        if grid.rank == 0:
            chosen = f"{backend} (auto)" if kernels_cfg.attention == "auto" else backend
            log.info("kernels: attention=%s, fused=%s, recompute=%s", chosen, kernels_cfg.fused, kernels_cfg.recompute)
        chunks = build_rank_chunks(cfg.model, grid, cfg.parallel.pipeline, kernels=kernels_cfg, tracker=self.tracker,
                                   backend=backend, sequence_parallel=cfg.parallel.sequence_parallel)
        for c, chunk in chunks.items():
            if cfg.init_from is None:
                init_full_view(chunk, cfg.seed)
            if chunk.ring is not None:  # the ring's waits are labelled too
                chunk.ring.watch = self.watch
            self.chunks[str(c)] = chunk
        if cfg.init_from is not None:  # a transformers model directory: each rank reads only its shards
            from mlplat.checkpoint.hf import load_into

            load_into(self.chunks.values(), cfg.init_from, grid)

    def configure_model(self) -> None:
        if len(self.chunks) == 0:
            self.build(self.trainer.strategy.grid, self.trainer.strategy.root_device)

    def _chunk_map(self) -> dict[int, GPTChunk]:
        return {int(k): v for k, v in self.chunks.items()}

    def _setup_engine(self) -> None:
        grid, parallel_cfg, model_cfg = self._grid, self.cfg.parallel, self.cfg.model
        grads = self._grad_buffer()  # first: it sets the weights' dtype, which the stage messages take
        dtype = next(self.parameters()).dtype
        device = next(self.parameters()).device
        comm = None
        if grid.pp > 1:
            # With sequence parallelism the stages exchange this rank's sequence shard: already 1/t of the
            # activation, and different on each tensor-parallel rank, so there is nothing to scatter or gather.
            sp = parallel_cfg.sequence_parallel  # validation refuses it at t < 2
            seq = model_cfg.seq_len // grid.cp  # a context-parallel rank's tokens
            seq = seq // grid.tp if sp else seq
            comm = StageComm(grid, (parallel_cfg.micro_batch_size, seq, model_cfg.hidden), dtype, device,
                             scatter_gather=parallel_cfg.scatter_gather and not sp,
                             wire_dtype=AUTOCAST_DTYPES.get(str(self.cfg.trainer.precision)))
        self.engine = PipelineEngine(self._chunk_map(), grid, parallel_cfg.pipeline, comm,
                                     before_backward=grads.before_backward, grad_ready=grads.grad_ready,
                                     watch=self.watch)
        if self.cfg.kernels.fused:
            self._compile_fused(comm, dtype, device)

    def _compile_fused(self, comm: StageComm | None, dtype: torch.dtype, device: torch.device) -> None:
        """Every fused operator compiled now, before any pipeline transfer is posted (mlplat.model.warmup)."""
        cfg, grid = self.cfg, self._grid
        zeros = torch.zeros(cfg.parallel.micro_batch_size, cfg.model.seq_len, dtype=torch.long, device=device)
        train = self._micro_batches((zeros, zeros, zeros) if cfg.data.pack else (zeros, zeros))[0]
        sample = None
        if cfg.sample.max_new_tokens > 0:
            one, _, placed = place(zeros[:1], zeros[:1, :0], cfg.model.seq_len, grid.cp, grid.cp_rank)
            sample = (one, None, placed)
        message = (comm.shape, comm.dtype) if comm is not None else (tuple(zeros.shape) + (cfg.model.hidden,), dtype)
        with self.watch.blocked_in("compiling the fused operators", "compute"):
            compile_fused(self._chunk_map(), train, sample, message, self.tracker, self._device)

    def _param_groups(self) -> list[list[nn.Parameter]]:
        """[decay, no decay]: no weight decay on biases and LayerNorm gains, as in Megatron/GPT-2."""
        params = list(self.parameters())
        return [[p for p in params if p.ndim >= 2], [p for p in params if p.ndim < 2]]

    def _grad_buffer(self) -> DataParallelGrads:
        """The flat gradient buffer, built on first use; under a Megatron precision the weights become bf16 (fp16)
        here, after their fp32 values are taken as the main weights."""
        if self.dp_grads is None:
            cfg, grid, chunks = self.cfg, self._grid, self._chunk_map()
            half = megatron_dtype(cfg.trainer.precision)
            current = next(self.parameters()).dtype
            self.dp_grads = DataParallelGrads(
                chunks, grid, self._param_groups(), param_dtype=half or current,
                main_dtype=torch.float32 if half is not None else current, distributed=cfg.optim.distributed,
                tied=[t for c in chunks.values() for t in c.tied_parameters()],
                sequence_parallel=sequence_parallel_replicated(self.parameters()),
                reduce_dtype=torch.bfloat16 if cfg.optim.grad_reduce_dtype == "bf16" else None)
        return self.dp_grads

    # -- optimisation --------------------------------------------------------------------------------
    def configure_optimizers(self):
        optim_cfg = self.cfg.optim
        decay, no_decay = self._param_groups()
        groups = [{"params": decay, "weight_decay": optim_cfg.weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
        grads = self._grad_buffer()  # the weights move into the flat buckets before any optimizer sees them
        if grads.own_main or grads.distributed:
            opt = self._main_params_optimizer(groups)
        else:
            opt = torch.optim.AdamW(groups, lr=optim_cfg.lr, betas=tuple(optim_cfg.betas), eps=optim_cfg.eps)
        schedule = partial(lr_factor, optim_cfg=optim_cfg, max_steps=self.cfg.trainer.max_steps)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def _main_params_optimizer(self, groups: list[dict]) -> MainParamsAdamW:
        """AdamW on the gradient buffer's main weights (its shards, sharded over dp when optim.distributed)."""
        optim_cfg, grid = self.cfg.optim, self._grid
        self.main = self._grad_buffer()
        opt = MainParamsAdamW(self.main, groups, lr=optim_cfg.lr, betas=optim_cfg.betas, eps=optim_cfg.eps)
        if grid.rank == 0:
            log.info("optimizer: main weights %s, weights %s, %s; optimizer state %.2f MiB on rank 0",
                     self.main.main_dtype, self.main.param_dtype,
                     f"sharded over dp={grid.dp}" if self.main.distributed else "not sharded",
                     optimizer_state_bytes(opt) / 2**20)
        return opt

    def _micro_batches(self, batch):
        """(token ids, labels, layout) per micro-batch: this context-parallel rank's tokens and where they sit
        (mlplat.parallel.placement.place; packed batches carry each token's document as a third element)."""
        tokens, labels, *documents = batch
        grid, mbs, s = self._grid, self.cfg.parallel.micro_batch_size, self.cfg.model.seq_len
        docs = documents[0].split(mbs) if documents else itertools.repeat(None)
        return [place(t, y, s, grid.cp, grid.cp_rank, d) for t, y, d in zip(tokens.split(mbs), labels.split(mbs), docs)]

    def _share_loss(self, loss: torch.Tensor | None, async_op: bool = False):
        """The mean loss over data-parallel replicas, on every rank (it is computed on the last stage); under
        async_op a function that waits for its all-reduce and returns it."""
        grid = self._grid
        # On the parallel device: NCCL reduces CUDA tensors only.
        value = torch.zeros((), dtype=torch.float64, device=self._device)
        if loss is not None and grid.tp_rank == 0:
            value += loss.detach().to(value.device, torch.float64)
        work = None
        if dist.is_available() and dist.is_initialized():
            work = dist.all_reduce(value, async_op=async_op)
        shares = grid.dp_cp  # each context-parallel rank's loss is its share of the mean, times c

        def shared() -> torch.Tensor:
            if work is not None and async_op:
                with self.watch.blocked_in("the loss all-reduce", "dp_comm"):
                    work.wait()
            return value / shares

        return shared if async_op else shared()

    def _pipeline_pass(self, batch, loss_scaler: DynamicLossScaler | None):
        """Forward and backward over the m micro-batches, then the gradient reductions; the loss (last stage) or
        None."""
        if self.engine is None:
            self._setup_engine()
        self.dp_grads.begin_step()
        scale = loss_scaler.scale if loss_scaler is not None else 1.0
        # The model's randomness comes from the tracker's stage stream (checkpointed), not the default generator.
        stream = self.tracker.fork(STAGE_RNG) if STAGE_RNG in self.tracker else contextlib.nullcontext()
        with stream:
            loss = self.engine.run(self._micro_batches(batch), loss_scale=scale)
        grads = self.dp_grads
        with self.watch.blocked_in("the data-parallel gradient reduction", "dp_comm"):
            grads.finish()
        with self.watch.blocked_in("the tied-embedding gradient all-reduce", "dp_comm"):
            grads.reduce_tied()
        with self.watch.blocked_in("the sequence-parallel gradient all-reduce", "tp_comm"):
            grads.reduce_sequence_parallel()
        return loss

    def pipeline_step(self, batch, loss_scaler: DynamicLossScaler | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward and backward over the m micro-batches plus gradient reductions; returns (loss, grad norm).

        With a loss scaler (fp16) the loss is scaled in the engine, the reduced gradients are unscaled, and
        `self.found_inf` says whether any rank saw an inf/NaN gradient (then nothing is clipped and the norm
        is inf: the caller must skip the optimizer step)."""
        loss = self._pipeline_pass(batch, loss_scaler)
        return self._checked(loss, loss_scaler)

    def _checked(self, loss: torch.Tensor | None, loss_scaler: DynamicLossScaler | None):
        """(loss, norm) of a pass whose gradients are reduced: unscaled, checked and clipped, the loss shared."""
        with self.watch.blocked_in("the gradient-norm all-reduce", "dp_comm"):
            self.found_inf, norm = self.dp_grads.unscale_and_clip_(loss_scaler, self.cfg.optim.grad_clip)
        with self.watch.blocked_in("the loss all-reduce", "dp_comm"):
            return self._share_loss(loss), norm

    def optimize(self, batch, opt, sched, scaler: DynamicLossScaler | None = None,
                 plugin=None) -> list[StepRecord]:
        """One training step on `batch` (zero_grad, the pipeline pass, the optimizer and the learning-rate
        schedule); returns the records of the steps settled by it, oldest first. `opt` may be Lightning's wrapper
        of the optimizer; `plugin` the Trainer's precision plugin.

        Synchronous (the default): the step's own record. Under optim.post_validate the optimizer steps before the
        clipping and inf/NaN checks are read, and they are read after the next step's pipeline pass
        (mlplat.parallel.post_validation): this step's record comes with the next step (or at the next settle
        point, `settle`), and the previous step's comes with this one. A step the checks reject is redone (clipping)
        or undone (an overflow), and the pass that ran on its weights runs again. Clipping and overflows come in runs,
        so the step after one that clipped, overflowed or was rejected is synchronous, and the one after a step that
        did neither is stepped first again. The weights, the optimizer and every record equal the synchronous run's."""
        self._local_steps += 1
        rng = rng_states(self.tracker) if self.pending is not None else None
        opt.zero_grad(set_to_none=True)
        loss = self._pipeline_pass(batch, scaler)
        settled = []
        if self.pending is not None:
            record, rejected = self._settle()
            settled.append(record)
            if rejected:  # this pass ran on the weights of a step that did not stand: again, on the settled ones
                set_rng_states(rng, self.tracker)
                opt.zero_grad(set_to_none=True)
                loss = self._pipeline_pass(batch, scaler)
        if self.cfg.optim.post_validate and self.step_first:
            self._step_first(loss, opt, sched, scaler, plugin)
        else:
            settled.append(self._synchronous_step(loss, opt, sched, scaler, plugin))
        return settled

    def _step_first(self, loss, opt, sched, scaler: DynamicLossScaler | None, plugin) -> None:
        """Post the checks and the loss's all-reduce, save what the step reads and writes, and step at once."""
        grads = self.dp_grads
        checks = PostedChecks(grads, scaler)
        shared = self._share_loss(loss, async_op=True)
        raw = getattr(opt, "optimizer", opt)  # under Lightning's wrapper: a redo is not a step of its own
        with self.watch.blocked_in("the optimizer step", "optimizer"):
            snapshot = StepSnapshot(raw, grads, sched, scaler)
            opt.step()
            self.found_inf = False
            self._after_step(sched, scaler)
        self.pending = PendingStep(self._step_number(), checks, snapshot, shared, (opt, sched, scaler, plugin))

    def _synchronous_step(self, loss, opt, sched, scaler: DynamicLossScaler | None, plugin) -> StepRecord:
        loss, norm = self._checked(loss, scaler)
        with self.watch.blocked_in("the optimizer step", "optimizer"):
            if not self.found_inf:
                opt.step()
            else:
                self._skip_step(opt, scaler, plugin)
            self._after_step(sched, scaler)
        if self.cfg.optim.post_validate:  # after a clipped or overflowed step, the next is synchronous too
            self.step_first = not (self.found_inf or clip_coefficient(float(norm), self.cfg.optim.grad_clip) < 1.0)
        return self._record(self._step_number(), loss, norm, sched, scaler, eager=False)

    def _settle(self) -> tuple[StepRecord, bool]:
        """(record, rejected) of the pending step: its checks read, and the step redone or undone if they say so."""
        # A settle point may sit inside Lightning's inference mode (validation on a GPU): a redone step's optimizer
        # state must not become inference tensors, which the next step could not update in place.
        with torch.inference_mode(False), torch.no_grad():
            return self._settle_pending()

    def _settle_pending(self) -> tuple[StepRecord, bool]:
        pending, self.pending = self.pending, None
        opt, sched, scaler, plugin = pending.context
        with self.watch.blocked_in("the post-validation all-reduces", "dp_comm"):
            self.found_inf, norm = pending.checks.wait()
        with self.watch.blocked_in("the loss all-reduce", "dp_comm"):
            loss = pending.loss()
        # Read on the host now, while nothing else is queued: the record needs no device sync later.
        loss, norm = loss.detach().cpu(), norm.detach().cpu()
        coef = 1.0 if self.found_inf else clip_coefficient(float(norm), self.cfg.optim.grad_clip)
        rejected = self.found_inf or coef < 1.0
        if rejected:
            grads = self.dp_grads
            with self.watch.blocked_in("the optimizer step", "optimizer"):
                self.redone_steps += 1
                grads.wait()  # the rejected step's all-gathers
                pending.snapshot.restore()
                if self.found_inf:
                    self._skip_step(None, scaler, plugin)
                    grads.refresh()  # the weights from the restored main weights
                else:
                    grads.scale_grads_(coef)
                    pending.snapshot.optimizer.step()
                self._after_step(sched, scaler)
        self.step_first = not rejected
        return self._record(pending.step, loss, norm, sched, scaler, eager=True), rejected

    def settle(self) -> StepRecord | None:
        """Settle the step taken before its checks were read, if there is one (every rank at the same point: before
        validation, a checkpoint, generation, the end of training); its record, kept and logged."""
        if self.pending is None:
            return None
        record, _ = self._settle()
        self._keep([record])
        self._unshown.append(record)
        return record

    def _step_number(self) -> int:
        """Optimizer steps so far, this one included: Lightning's global_step under a Trainer."""
        trainer = self._trainer
        return trainer.global_step if trainer is not None else self._local_steps

    def _record(self, step: int, loss, norm, sched, scaler: DynamicLossScaler | None, eager: bool) -> StepRecord:
        post = self.cfg.optim.post_validate
        return StepRecord(step, loss.detach().cpu(), norm.detach().cpu(), sched.get_last_lr()[0], eager,
                          scaler.scale if scaler is not None else None,
                          scaler.skipped_steps if scaler is not None else None,
                          self.redone_steps if post else None)

    def _skip_step(self, opt, scaler: DynamicLossScaler, plugin) -> None:
        """An overflowed step: every rank saw the same all-reduced flag, so all skip together. Through Lightning
        the step is still counted (`global_step`) without moving the optimizer; `opt` None: already counted."""
        trainer = self._trainer  # None when the module is driven without a Trainer
        if trainer is not None and trainer.is_global_zero:
            log.warning("step %d: inf/NaN gradients at loss scale %g; optimizer step skipped, scale -> %g",
                        trainer.global_step + (1 if opt is not None else 0), scaler.scale,
                        max(scaler.min_scale, scaler.scale * scaler.backoff_factor))
        if opt is not None and isinstance(plugin, SkipsOverflowedSteps):
            plugin.skip_next_step = True
            opt.step()  # Lightning counts the step (global_step), the plugin does not apply it

    def _after_step(self, sched, scaler: DynamicLossScaler | None) -> None:
        if scaler is not None:
            scaler.update(self.found_inf)
        if not self.found_inf:
            sched.step()  # a skipped step does not advance the learning-rate schedule (as in Megatron)

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        sched = self.lr_schedulers()
        plugin = self.trainer.precision_plugin
        scaler = getattr(plugin, "loss_scaler", None) or self.loss_scaler
        records = self.optimize(batch, opt, sched, scaler, plugin)
        with self.watch.blocked_in("logging", "loop"):
            self._keep(records)
            self._show(records, on_step=True)
        return None

    def _show(self, records: list[StepRecord], on_step: bool) -> None:
        """The progress bar and callback_metrics (the loggers get the records in `_keep`), with the steps settled
        since the last training step first (before validation, a checkpoint, generation): otherwise both would
        hold the step before a settled one's figures until the next record."""
        records, self._unshown = self._unshown + records, []
        for record in records:
            for name, value in record.metrics().items():
                value = value if isinstance(value, torch.Tensor) else torch.tensor(float(value))
                self.log(name, value, prog_bar=name == "train_loss", on_step=on_step, on_epoch=not on_step,
                         logger=False, rank_zero_only=True)

    def _keep(self, records: list[StepRecord], final: bool = False) -> None:
        """Settled steps: kept for the callbacks (the last few), and sent to the loggers on global rank 0 at the
        step Lightning logs that step's other metrics under (its batch index), every trainer.log_every_n_steps
        steps, and the last step at the end (`final`). A record can settle a step after its own (post-validation),
        so it is sent here and not through `self.log`, which would file it under the current step."""
        trainer = self._trainer
        for record in records:
            self.records[record.step] = record
            while len(self.records) > RECORDS_KEPT:
                self.records.pop(min(self.records))
        if trainer is None or not trainer.is_global_zero:
            return
        every = trainer.log_every_n_steps
        due = [r for r in records if r.step % every == 0]
        last = self.records[max(self.records)] if final and self.records else None
        if last is not None and last.step % every != 0:
            due.append(last)
        for record in due:
            metrics = {name: float(value) for name, value in record.metrics().items()}
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=record.step - 1)

    def validation_step(self, batch, batch_idx):
        if self.engine is None:
            self._setup_engine()
        loss = self.engine.run(self._micro_batches(batch), forward_only=True)
        # float64 runs (64-true) log every digit, as train_loss does; the rest float32 (not bf16's 3 digits).
        dtype = torch.float64 if next(self.parameters()).dtype == torch.float64 else torch.float32
        value = self._share_loss(loss).to(dtype)
        self.log("val_loss", value, prog_bar=True, on_epoch=True, rank_zero_only=True)

    # -- where a step taken before its checks must be settled: its weights or state are read next -------------
    def on_validation_start(self) -> None:
        self.settle()

    def on_train_epoch_end(self) -> None:
        self.settle()  # before any callback's on_train_end (metrics.csv's last row, the summary, the sample)
        self._show([], on_step=False)  # Lightning takes no per-step values here: the epoch's, from one value

    def on_train_end(self) -> None:
        self.settle()
        self._keep([], final=True)  # the last step's figures, whatever trainer.log_every_n_steps
        if self.dp_grads is not None:
            self.dp_grads.wait()  # the last step's all-gathers: no collective left in flight at teardown

    # -- generation ----------------------------------------------------------------------------------
    def generate(self, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int = 0) -> list[int]:
        """Decoding through the pipeline (`mlplat.model.generation`): every rank takes part and returns the
        same tokens."""
        if self.engine is None:
            self._setup_engine()
        self.settle()
        was_training = self.training
        self.eval()
        ids = generation.generate(self.engine, self.cfg.model, prompt_ids,
                                  max_new_tokens, temperature, top_k, top_p, seed,
                                  device=next(self.parameters()).device)
        self.train(was_training)
        return ids
