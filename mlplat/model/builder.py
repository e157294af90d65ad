"""This rank's model as a training step runs it: its chunks built, initialised (or read from `init_from`) and placed
(`build_model`), the parts of the model that take part in every step (`step_hooks`), and the modes a pass puts
the chunks in (`eval_mode`, `weights_fixed`). No Lightning and no Hydra here."""
from __future__ import annotations

import contextlib
import logging
from typing import Callable, Iterable

import torch
import torch.nn as nn

from mlplat.config import RunConfig
from mlplat.model.attention import resolve_backend
from mlplat.model.decoder import DecoderChunk, build_rank_chunks
from mlplat.model.init import init_full_view
from mlplat.model.moe import MoELayer
from mlplat.parallel.grid import ParallelGrid
from mlplat.parallel.hang import HangWatch
from mlplat.parallel.random import RNGTracker
from mlplat.precision import precision_of

log = logging.getLogger("mlplat")


def weight_dtype(precision: str) -> torch.dtype:
    """The dtype the chunks are built in: the table's weight dtype, fp32 under a Megatron precision (the gradient
    buffer takes those values as the main weights, then casts the weights)."""
    entry = precision_of(precision)
    return torch.float32 if entry.megatron else getattr(torch, entry.weight_dtype)


def build_model(cfg: RunConfig, grid: ParallelGrid, device: torch.device, tracker: RNGTracker, watch: HangWatch,
                read_init: Callable[[Iterable[DecoderChunk], str, ParallelGrid], None] | None = None,
                ) -> tuple[dict[int, DecoderChunk], str]:
    """(chunk id -> chunk, the attention backend) of this rank: initialised from cfg.seed (the same weights under
    every layout) or read from the transformers directory `init_from` by `read_init` (`mlplat.checkpoint.hf.
    load_into`, which the caller passes: checkpoint/ reads the model's names, so it sits above model/; each rank
    reads only its shards), on `device` in `weight_dtype`. The chunks draw their randomness from `tracker`; `watch`
    labels a ring's waits."""
    kernels_cfg = cfg.kernels
    backend = resolve_backend(kernels_cfg.attention, device.type, cfg.trainer.precision, grid.cp,
                              *cfg.model.attention_entry.head_dims(cfg.model))
    if grid.rank == 0:
        chosen = f"{backend} (auto)" if kernels_cfg.attention == "auto" else backend
        log.info("kernels: attention=%s, fused=%s, recompute=%s", chosen, kernels_cfg.fused, kernels_cfg.recompute)
    # Built and initialised in the weights' dtype, as Lightning's precision plugins build a module: the same
    # initial weights with or without a Trainer.
    # A resumed run's checkpoint holds its weights and optimizer: init_from's would be read only to be replaced.
    init_from = cfg.init_from if cfg.ckpt_path is None else None
    if cfg.init_from is not None and init_from is None and grid.rank == 0:
        log.info("init_from=%s not read: ckpt_path=%s resumes the run's own weights and optimizer", cfg.init_from,
                 cfg.ckpt_path)
    dtype, default = weight_dtype(str(cfg.trainer.precision)), torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        chunks = build_rank_chunks(cfg.model, grid, cfg.parallel.pipeline, kernels=kernels_cfg, tracker=tracker,
                                   backend=backend, sequence_parallel=cfg.parallel.sequence_parallel)
        for chunk in chunks.values():
            if init_from is None:
                init_full_view(chunk, cfg.seed)
            if chunk.ring is not None:  # the ring's waits are labelled too
                chunk.ring.watch = watch
            for module in chunk.modules():  # and the expert dispatchers' (the straggler clock takes them out)
                if isinstance(module, MoELayer):
                    module.dispatcher.watch = watch
    finally:
        torch.set_default_dtype(default)
    if init_from is not None:
        assert read_init is not None, "init_from needs a reader of its directory"
        read_init(chunks.values(), init_from, grid)
    return {c: chunk.to(device=device, dtype=dtype) for c, chunk in chunks.items()}, backend


def step_hooks(cfg: RunConfig, chunks: dict[int, nn.Module], grid: ParallelGrid, device: torch.device,
               watch: HangWatch) -> list:
    """The model's parts that take part in each training step beside the loss (the step's hook protocol,
    `mlplat.step.hooks.StepHook`): a mixture of experts' balancing and load figures (`mlplat.model.moe_step`), on
    every rank of a model with experts, also one whose stage holds only dense layers (the loss's all-reduce
    carries every layer's figures); the multi-token prediction's losses per depth (`mlplat.model.mtp_step`), on
    every rank likewise; QK-clip's logit maxima and the factors of the query and key rows (`mlplat.model.qk_clip`)
    under optim.muon.qk_clip."""
    hooks = []
    if cfg.model.moe.enabled:
        from mlplat.model.moe_step import MoEStep

        hooks.append(MoEStep(chunks, cfg.model, grid, device, watch))
    if cfg.model.mtp.enabled:
        from mlplat.model.mtp_step import MTPStep

        hooks.append(MTPStep(chunks, cfg.model, grid))
    if cfg.optim.name == "muon" and cfg.optim.muon.qk_clip is not None:
        from mlplat.model.qk_clip import QKClipStep

        hooks.append(QKClipStep(chunks, cfg.model, cfg.optim.muon.qk_clip, device, watch))
    return hooks


@contextlib.contextmanager
def eval_mode(chunks: Iterable[nn.Module]):
    """The chunks in eval mode (no dropout), then back in the mode each was in."""
    modes = [(chunk, chunk.training) for chunk in chunks]
    for chunk, _ in modes:
        chunk.eval()
    try:
        yield
    finally:
        for chunk, mode in modes:
            chunk.train(mode)


@contextlib.contextmanager
def weights_fixed(chunks: Iterable[nn.Module]):
    """A pipeline pass, over which the weights do not change: the FP8 casts of the weights are made at their first
    use in it and kept to its end (`mlplat.parallel.fp8.WeightCasts`), once per optimizer step. Dropped before (the
    weights may have changed since: a step, a restored or redone one, a load) and after."""
    casts = [c.weight_casts for c in chunks if getattr(c, "weight_casts", None) is not None]
    for store in casts:
        store.clear()
    try:
        yield
    finally:
        for store in casts:
            store.clear()
