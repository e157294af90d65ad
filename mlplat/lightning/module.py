"""The LightningModule: builds this rank's model chunks from the grid and runs one PTD-P step per batch.

Manual optimisation: a step is the pipeline schedule over m micro-batches (forward and backward inside it),
then the gradient reductions (data-parallel buckets, tied embedding, the parameters applied to sequence-parallel
shards over the tensor-parallel group), global-norm clipping (each of those counted once), the optimizer and
the learning-rate schedule. The loss lives on the last pipeline stage and is shared with every rank for logging.

The optimizer is torch's AdamW on the parameters, or, for the Megatron-style precisions (bf16-megatron,
16-megatron) and the distributed optimizer (optim.distributed=true), `MainParamsAdamW` on flat main weights and
gradients (`mlplat.parallel.main_params`), sharded over the data-parallel ranks when distributed.
"""
from __future__ import annotations

import contextlib
import logging
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
from mlplat.parallel.data_parallel import DataParallelGrads, clip_grad_norm_, reduce_tied_grads
from mlplat.parallel.grid import ParallelGrid
from mlplat.parallel.hang import HangWatch
from mlplat.parallel.loss_scale import DynamicLossScaler
from mlplat.parallel.main_params import MainParams, MainParamsAdamW, megatron_dtype, optimizer_state_bytes
from mlplat.parallel.pipeline.engine import PipelineEngine
from mlplat.parallel.pipeline.p2p import StageComm
from mlplat.parallel.random import STAGE_RNG, RNGTracker, seed_model_parallel
from mlplat.parallel.sequence import reduce_sequence_parallel_grads, sequence_parallel_replicated

log = logging.getLogger("mlplat")
# The GEMMs' dtype of Lightning's autocast precisions: stage messages travel in it (the other precisions' weights,
# and so their activations, are already in it).
AUTOCAST_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


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
        self.main: MainParams | None = None  # main weights and gradients, when the optimizer works on them

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
        backend = resolve_backend(kernels_cfg.attention, dev.type, cfg.trainer.precision)
        self.attention_backend = backend
        if grid.rank == 0:
            chosen = f"{backend} (auto)" if kernels_cfg.attention == "auto" else backend
            log.info("kernels: attention=%s, fused=%s, recompute=%s", chosen, kernels_cfg.fused, kernels_cfg.recompute)
        chunks = build_rank_chunks(cfg.model, grid, cfg.parallel.pipeline, kernels=kernels_cfg, tracker=self.tracker,
                                   backend=backend, sequence_parallel=cfg.parallel.sequence_parallel)
        for c, chunk in chunks.items():
            if cfg.init_from is None:
                init_full_view(chunk, cfg.seed)
            self.chunks[str(c)] = chunk
        if cfg.init_from is not None:  # a transformers GPT-2 directory: each rank reads only its shards
            from mlplat.checkpoint.hf import load_into

            load_into(self.chunks.values(), cfg.init_from, grid)

    def configure_model(self) -> None:
        if len(self.chunks) == 0:
            self.build(self.trainer.strategy.grid, self.trainer.strategy.root_device)

    def _chunk_map(self) -> dict[int, GPTChunk]:
        return {int(k): v for k, v in self.chunks.items()}

    def _setup_engine(self) -> None:
        grid, parallel_cfg, model_cfg = self._grid, self.cfg.parallel, self.cfg.model
        dtype = next(self.parameters()).dtype
        device = next(self.parameters()).device
        comm = None
        if grid.pp > 1:
            # With sequence parallelism the stages exchange this rank's sequence shard: already 1/t of the
            # activation, and different on each tensor-parallel rank, so there is nothing to scatter or gather.
            sp = parallel_cfg.sequence_parallel and grid.tp > 1
            seq = model_cfg.seq_len // grid.tp if sp else model_cfg.seq_len
            comm = StageComm(grid, (parallel_cfg.micro_batch_size, seq, model_cfg.hidden), dtype, device,
                             scatter_gather=parallel_cfg.scatter_gather and not sp,
                             wire_dtype=AUTOCAST_DTYPES.get(str(self.cfg.trainer.precision)))
        chunks = self._chunk_map()
        if getattr(self, "dp_grads", None) is not None:
            self.dp_grads.remove_hooks()  # set up again (the optimizer now owns main gradients)
        self.dp_grads = DataParallelGrads(chunks, grid, main=self.main)
        self.engine = PipelineEngine(chunks, grid, parallel_cfg.pipeline, comm,
                                     before_backward=self.dp_grads.before_backward,
                                     grad_ready=self.dp_grads.grad_ready, watch=self.watch)
        self.tied = [t for c in chunks.values() for t in c.tied_parameters()]
        self.sequence_parallel_params = sequence_parallel_replicated(self.parameters())

    # -- optimisation --------------------------------------------------------------------------------
    def configure_optimizers(self):
        optim_cfg = self.cfg.optim
        decay, no_decay = [], []
        for param in self.parameters():
            # No weight decay on biases and LayerNorm gains, as in Megatron/GPT-2.
            (no_decay if param.ndim < 2 else decay).append(param)
        groups = [{"params": decay, "weight_decay": optim_cfg.weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
        half = megatron_dtype(self.cfg.trainer.precision)
        if half is not None or optim_cfg.distributed:
            opt = self._main_params_optimizer(groups, half)
        else:
            opt = torch.optim.AdamW(groups, lr=optim_cfg.lr, betas=tuple(optim_cfg.betas), eps=optim_cfg.eps)
        schedule = partial(lr_factor, optim_cfg=optim_cfg, max_steps=self.cfg.trainer.max_steps)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def _main_params_optimizer(self, groups: list[dict], half: torch.dtype | None) -> MainParamsAdamW:
        """Flat main weights and gradients (sharded over dp when optim.distributed); under a Megatron precision
        the weights become `half` here, after their fp32 values are taken as the main weights."""
        optim_cfg, grid = self.cfg.optim, self._grid
        if self.main is not None:
            self.main.remove_hooks()
        current = next(self.parameters()).dtype
        chunks = self._chunk_map()
        self.main = MainParams(chunks, grid, [g["params"] for g in groups], param_dtype=half or current,
                               main_dtype=torch.float32 if half is not None else current,
                               distributed=optim_cfg.distributed,
                               tied=[t for c in chunks.values() for t in c.tied_parameters()],
                               reduce_dtype=torch.bfloat16 if optim_cfg.grad_reduce_dtype == "bf16" else None)
        self.engine = None  # the reducer is rebuilt over the main gradients (and messages take the new dtype)
        opt = MainParamsAdamW(self.main, groups, lr=optim_cfg.lr, betas=optim_cfg.betas, eps=optim_cfg.eps)
        if grid.rank == 0:
            log.info("optimizer: main weights %s, weights %s, %s; optimizer state %.2f MiB on rank 0",
                     self.main.main_dtype, self.main.param_dtype,
                     f"sharded over dp={grid.dp}" if self.main.distributed else "not sharded",
                     optimizer_state_bytes(opt) / 2**20)
        return opt

    def _micro_batches(self, batch):
        tokens, labels = batch
        mbs = self.cfg.parallel.micro_batch_size
        return list(zip(tokens.split(mbs), labels.split(mbs)))

    def _share_loss(self, loss: torch.Tensor | None) -> torch.Tensor:
        """The mean loss over data-parallel replicas, on every rank (it is computed on the last stage)."""
        grid = self._grid
        # On the parallel device: NCCL reduces CUDA tensors only.
        value = torch.zeros((), dtype=torch.float64, device=self._device)
        if loss is not None and grid.tp_rank == 0:
            value += loss.detach().to(value.device, torch.float64)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(value)
        return value / grid.dp

    def pipeline_step(self, batch, loss_scaler: DynamicLossScaler | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward and backward over the m micro-batches plus gradient reductions; returns (loss, grad norm).

        With a loss scaler (fp16) the loss is scaled in the engine, the reduced gradients are unscaled, and
        `self.found_inf` says whether any rank saw an inf/NaN gradient (then nothing is clipped and the norm
        is inf: the caller must skip the optimizer step)."""
        if self.engine is None:
            self._setup_engine()
        self.dp_grads.begin_step()
        scale = loss_scaler.scale if loss_scaler is not None else 1.0
        # The model's randomness comes from the tracker's stage stream (checkpointed), not the default generator.
        stream = self.tracker.fork(STAGE_RNG) if STAGE_RNG in self.tracker else contextlib.nullcontext()
        with stream:
            loss = self.engine.run(self._micro_batches(batch), loss_scale=scale)
        with self.watch.blocked_in("the data-parallel gradient reduction", "dp_comm"):
            self.dp_grads.finish()
        if self.main is not None:
            return self._finish_main_grads(loss, loss_scaler)
        with self.watch.blocked_in("the tied-embedding gradient all-reduce", "dp_comm"):
            reduce_tied_grads(self.tied, self._grid)
        with self.watch.blocked_in("the sequence-parallel gradient all-reduce", "tp_comm"):
            reduce_sequence_parallel_grads(self.sequence_parallel_params, self._grid)
        params = list(self.parameters())
        with self.watch.blocked_in("the gradient-norm all-reduce", "dp_comm"):
            self.found_inf = loss_scaler is not None and loss_scaler.unscale_(params)
            if self.found_inf:
                norm = torch.full((), float("inf"), device=self._device)
            else:
                norm = clip_grad_norm_(params, self._grid, self.cfg.optim.grad_clip)
        with self.watch.blocked_in("the loss all-reduce", "dp_comm"):
            return self._share_loss(loss), norm

    def _finish_main_grads(self, loss, loss_scaler) -> tuple[torch.Tensor, torch.Tensor]:
        """pipeline_step's end on main gradients: the tied and sequence-parallel sums, unscaling and clipping act on
        this rank's shards."""
        main = self.main
        with self.watch.blocked_in("the tied-embedding gradient all-reduce", "dp_comm"):
            main.reduce_tied()
        with self.watch.blocked_in("the sequence-parallel gradient all-reduce", "tp_comm"):
            main.reduce_over_tp(self.sequence_parallel_params)
        with self.watch.blocked_in("the gradient-norm all-reduce", "dp_comm"):
            self.found_inf = loss_scaler is not None and loss_scaler.unscale_grads_(main.shard_grads())
            if self.found_inf:
                norm = torch.full((), float("inf"), device=self._device)
            else:
                norm = main.clip_grad_norm_(self.cfg.optim.grad_clip)
        with self.watch.blocked_in("the loss all-reduce", "dp_comm"):
            return self._share_loss(loss), norm

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        sched = self.lr_schedulers()
        opt.zero_grad(set_to_none=True)
        plugin = self.trainer.precision_plugin
        scaler = getattr(plugin, "loss_scaler", None) or self.loss_scaler
        loss, norm = self.pipeline_step(batch, scaler)
        with self.watch.blocked_in("the optimizer step", "optimizer"):
            self._optimizer_step(opt, sched, scaler, plugin)
        with self.watch.blocked_in("logging", "loop"):
            self.log("train_loss", loss, prog_bar=True, on_step=True, logger=True, rank_zero_only=True)
            if scaler is not None:
                self.log("loss_scale", torch.tensor(scaler.scale), on_step=True, rank_zero_only=True)
                self.log("skipped_steps", torch.tensor(float(scaler.skipped_steps)), on_step=True,
                         rank_zero_only=True)
            self.log("grad_norm", norm.float().detach().cpu(), on_step=True, rank_zero_only=True)
            self.log("lr", torch.tensor(sched.get_last_lr()[0]), on_step=True, rank_zero_only=True)
        return None

    def _optimizer_step(self, opt, sched, scaler: DynamicLossScaler | None, plugin) -> None:
        if not self.found_inf:
            opt.step()
        else:
            # Every rank saw the same all-reduced flag, so all skip together.
            if self.trainer.is_global_zero:
                log.warning("step %d: inf/NaN gradients at loss scale %g; optimizer step skipped, scale -> %g",
                            self.trainer.global_step + 1, scaler.scale,
                            max(scaler.min_scale, scaler.scale * scaler.backoff_factor))
            if isinstance(plugin, SkipsOverflowedSteps):
                plugin.skip_next_step = True
                opt.step()  # Lightning counts the step (global_step), the plugin does not apply it
        if scaler is not None:
            scaler.update(self.found_inf)
        if not self.found_inf:
            sched.step()  # a skipped step does not advance the learning-rate schedule (as in Megatron)

    def validation_step(self, batch, batch_idx):
        if self.engine is None:
            self._setup_engine()
        loss = self.engine.run(self._micro_batches(batch), forward_only=True)
        # float64 runs (64-true) log every digit, as train_loss does; the rest float32 (not bf16's 3 digits).
        dtype = torch.float64 if next(self.parameters()).dtype == torch.float64 else torch.float32
        value = self._share_loss(loss).to(dtype)
        self.log("val_loss", value, prog_bar=True, on_epoch=True, rank_zero_only=True)

    def on_train_end(self) -> None:
        if self.main is not None:
            self.main.wait()  # the last step's all-gathers: no collective left in flight at teardown

    # -- generation ----------------------------------------------------------------------------------
    def generate(self, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int = 0) -> list[int]:
        """Decoding through the pipeline (`mlplat.model.generation`): every rank takes part and returns the
        same tokens."""
        if self.engine is None:
            self._setup_engine()
        was_training = self.training
        self.eval()
        ids = generation.generate(self.engine, self.cfg.model, self.cfg.parallel.micro_batch_size, prompt_ids,
                                  max_new_tokens, temperature, top_k, top_p, seed,
                                  device=next(self.parameters()).device)
        self.train(was_training)
        return ids
