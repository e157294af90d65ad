"""The fused operators compiled before step 1, outside any pipeline transfer (kernels.fused=true).

A fused operator compiles on its first call with each signature (`mlplat.model.fused`). Left to the first step, that
call sits in a stage's first forward: stage s starts computing only once stages 0..s-1 have compiled, while stage
s+1 waits on its posted receive, so at p = 64 the late stages pass the hang watch; on a GPU, Inductor's first-launch
autotuning also synchronises the device, which waits for the transfers already posted. The same happens again at the
first validation, the first recomputed backward and the end-of-run sample.

So before step 1 every rank runs each of its chunks' forwards once on zeros, with nothing posted, in every mode a
run calls them in: training (grad enabled, as the model does it, and with recomputation also without it: the
signature of the recomputed forward), validation (eval, no grad) and generation (one sequence, no autocast: the
sample is drawn outside Lightning's step). The forwards hold tensor- and context-parallel collectives; the peers of a
stage hold the same chunks and run them in the same order, so those match. With sharded parameters
(`mlplat.optim.param_gather`) the forwards gather each layer over the data-parallel ranks, which run the same
forwards in the same order too. No pipeline communication runs, no gradient is computed, and every RNG state is
put back, so training is unchanged.

Then the ranks agree: an operator that failed to compile on one rank runs eagerly there, so if any rank fell back,
every rank runs every operator eagerly (replicated weights must see the same arithmetic).
"""
from __future__ import annotations

import contextlib
import logging
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from mlplat.model import fused
from mlplat.parallel.grid import dist_ready
from mlplat.parallel.random import rng_states, set_rng_states

log = logging.getLogger("mlplat")


@contextlib.contextmanager
def _recomputation_off(chunk: nn.Module) -> Iterator[None]:
    """The chunk's layers run plainly: what a recomputed forward runs (grad enabled, inputs that need grad)."""
    flagged = [(m, name) for m in chunk.modules() for name in ("full_recompute", "selective")
               if getattr(m, name, False)]
    for m, name in flagged:
        setattr(m, name, False)
    try:
        yield
    finally:
        for m, name in flagged:
            setattr(m, name, True)


def _forwards(chunks: dict[int, nn.Module], micro_batch: tuple, message: tuple[tuple[int, ...], torch.dtype],
              grad: bool) -> None:
    """Each chunk's forward, ascending: token ids into the first, a zero stage message into the others."""
    tokens, labels, layout = micro_batch
    shape, dtype = message
    extra = {"layout": layout} if layout is not None else {}
    for c in sorted(chunks):
        chunk = chunks[c]
        x = tokens if chunk.is_first else torch.zeros(shape, dtype=dtype, device=tokens.device, requires_grad=grad)
        chunk(x, labels if chunk.is_last else None, **extra)


def compile_fused(chunks: dict[int, nn.Module], train: tuple, sample: tuple | None,
                  message: tuple[tuple[int, ...], torch.dtype], tracker, device: torch.device) -> None:
    """Compile every fused operator this rank's chunks call, in every mode (see the module docstring).

    train: a micro-batch (token ids, labels, layout) as the engine takes it; sample: generation's one sequence
    (token ids, None, layout), or None when the run draws no sample; message: the stage message's shape and dtype
    (a micro-batch of it: its first dimension is scaled for the sample's one sequence)."""
    if fused.get_impl() == "eager" or not chunks:
        return
    states = rng_states(tracker)
    modes = {c: c.training for c in chunks.values()}
    recomputes = any(getattr(m, "full_recompute", False) or getattr(m, "selective", False)
                     for c in chunks.values() for m in c.modules())
    try:
        for c in chunks.values():
            c.train()
        with torch.enable_grad():
            _forwards(chunks, train, message, grad=True)
            if recomputes:
                with contextlib.ExitStack() as stack:
                    for c in chunks.values():
                        stack.enter_context(_recomputation_off(c))
                    _forwards(chunks, train, message, grad=True)
        for c in chunks.values():
            c.eval()
        with torch.no_grad():
            _forwards(chunks, train, message, grad=False)
            if sample is not None:
                shape, dtype = message
                with torch.autocast(device.type, enabled=False):
                    _forwards(chunks, sample, ((sample[0].size(0), *shape[1:]), dtype), grad=False)
    finally:
        for c, training in modes.items():
            c.train(training)
        set_rng_states(states, tracker)
    _agree(device)


def _agree(device: torch.device) -> None:
    """Every rank runs every operator eagerly if any rank's compilation failed."""
    failed = [op.__name__ for op in fused.FUSED_OPS if op.failure is not None]
    if dist_ready():
        flag = torch.tensor([float(bool(failed))], device=device)  # on the parallel device: NCCL reduces CUDA only
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        anywhere = bool(flag.item())
    else:
        anywhere = bool(failed)
    if anywhere:
        fused.set_impl("eager")
        if not dist_ready() or dist.get_rank() == 0:
            log.warning("kernels.fused: a fused operator failed to compile on some rank (%s here); every rank runs "
                        "every operator eagerly (the same functions)", ", ".join(failed) or "none")
