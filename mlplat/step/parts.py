"""The parts a training step runs, built from the config: the gradient buffer (`build_grads`) and its reductions
after a pass (`reduce_grads`), the pipeline engine (`build_engine`) and a batch cut into micro-batches
(`micro_batches`). No Lightning and no Hydra here."""
from __future__ import annotations

import itertools

import torch
import torch.nn as nn

from mlplat.config import RunConfig
from mlplat.model.warmup import compile_fused
from mlplat.optim.buffers import ParamBuffers
from mlplat.optim.factory import param_groups
from mlplat.optim.main_params import megatron_dtype
from mlplat.parallel.grid import ParallelGrid
from mlplat.parallel.hang import HangWatch
from mlplat.parallel.pipeline.engine import PipelineEngine
from mlplat.parallel.pipeline.p2p import StageComm
from mlplat.parallel.placement import place
from mlplat.parallel.random import RNGTracker
from mlplat.parallel.sequence import sequence_parallel_replicated
from mlplat.precision import TABLE

# The GEMMs' dtype of the autocast precisions: stage messages travel in it (the other precisions' weights, and so
# their activations, are already in it).
AUTOCAST_DTYPES = {n: getattr(torch, e.compute_dtype) for n, e in TABLE.items() if e.autocast}


def micro_batches(cfg: RunConfig, grid: ParallelGrid, batch) -> list[tuple]:
    """(token ids, labels, layout) per micro-batch: this context-parallel rank's tokens and where they sit
    (mlplat.parallel.placement.place; packed batches carry each token's document as a third element)."""
    tokens, labels, *documents = batch
    mbs, s = cfg.parallel.micro_batch_size, cfg.model.seq_len
    docs = documents[0].split(mbs) if documents else itertools.repeat(None)
    return [place(t, y, s, grid.cp, grid.cp_rank, d) for t, y, d in zip(tokens.split(mbs), labels.split(mbs), docs)]


def build_grads(cfg: RunConfig, grid: ParallelGrid, chunks: dict[int, nn.Module], whole_params: bool,
                work=None, **options) -> ParamBuffers:
    """The flat gradient buffer and every gradient reduction; under a Megatron precision the weights become bf16
    (fp16) here, after their fp32 values are taken as the main weights. `whole_params`: the optimizer reads each
    parameter whole (its registration's whole_matrices), its shards balanced by `work` (the registration's);
    `options` go to `ParamBuffers` (bucket_bytes, overlap)."""
    params = [p for chunk in chunks.values() for p in chunk.parameters()]
    half, current = megatron_dtype(cfg.trainer.precision), params[0].dtype
    return ParamBuffers(
        chunks, grid, param_groups(params), param_dtype=half or current,
        main_dtype=torch.float32 if half is not None else current, distributed=cfg.optim.distributed,
        shard_params=cfg.optim.sharding == "params", split_backward=cfg.parallel.pipeline.spec.split_backward,
        whole_params=whole_params, work=work, tied=[t for c in chunks.values() for t in c.tied_parameters()],
        sequence_parallel=sequence_parallel_replicated(params),
        reduce_dtype=torch.bfloat16 if cfg.optim.grad_reduce_dtype == "bf16" else None, **options)


def reduce_grads(grads: ParamBuffers, watch: HangWatch) -> None:
    """After a pass's backward: the data-parallel reductions, then the sums over other groups, each labelled."""
    with watch.blocked_in("the data-parallel gradient reduction", "dp_comm"):
        grads.finish()
    with watch.blocked_in("the tied-embedding gradient all-reduce", "dp_comm"):
        grads.reduce_tied()
    if grads.shared:  # key/value heads held by several tp ranks
        with watch.blocked_in("the shared key/value heads' gradient all-reduce", "tp_comm"):
            grads.reduce_shared_rows()
    with watch.blocked_in("the sequence-parallel gradient all-reduce", "tp_comm"):
        grads.reduce_sequence_parallel()


def build_engine(cfg: RunConfig, grid: ParallelGrid, chunks: dict[int, nn.Module], grads: ParamBuffers,
                 watch: HangWatch, tracker: RNGTracker, device: torch.device) -> PipelineEngine:
    """The pipeline engine over `chunks`, feeding `grads`, in the weights' dtype (after `build_grads` set it); with
    kernels.fused every fused operator is compiled here, before any pipeline transfer is posted
    (mlplat.model.warmup)."""
    parallel_cfg, model_cfg = cfg.parallel, cfg.model
    first = next(p for chunk in chunks.values() for p in chunk.parameters())
    comm = None
    if grid.pp > 1:
        # With sequence parallelism the stages exchange this rank's sequence shard: already 1/t of the activation,
        # and different on each tensor-parallel rank, so there is nothing to scatter or gather.
        sp = parallel_cfg.sequence_parallel  # validation refuses it at t < 2
        seq = model_cfg.seq_len // grid.cp  # a context-parallel rank's tokens
        seq = seq // grid.tp if sp else seq
        comm = StageComm(grid, (parallel_cfg.micro_batch_size, seq, model_cfg.hidden), first.dtype, first.device,
                         scatter_gather=parallel_cfg.scatter_gather and not sp,
                         wire_dtype=AUTOCAST_DTYPES.get(str(cfg.trainer.precision)))
    engine = PipelineEngine(chunks, grid, parallel_cfg.pipeline, comm, before_backward=grads.before_backward,
                            grad_ready=grads.grad_ready, watch=watch)
    if cfg.kernels.fused:
        zeros = torch.zeros(parallel_cfg.micro_batch_size, model_cfg.seq_len, dtype=torch.long, device=device)
        train = micro_batches(cfg, grid, (zeros, zeros, zeros) if cfg.data.pack else (zeros, zeros))[0]
        sample = None
        if cfg.sample.max_new_tokens > 0:
            one, _, placed = place(zeros[:1], zeros[:1, :0], model_cfg.seq_len, grid.cp, grid.cp_rank)
            sample = (one, None, placed)
        message = (comm.shape, comm.dtype) if comm is not None else ((*zeros.shape, model_cfg.hidden), first.dtype)
        with watch.blocked_in("compiling the fused operators", "compute"):
            compile_fused(chunks, train, sample, message, tracker, device)
    return engine
