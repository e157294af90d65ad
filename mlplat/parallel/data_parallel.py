"""Gradient reductions after the pipeline's backward: data-parallel averaging in overlapped buckets, the tied
embedding's sum between first and last stage, and the global gradient norm over the whole grid.

Data parallelism: gradients accumulate locally over the m micro-batches; only during the last micro-batch's
backward of a chunk are its parameters' gradients final, so their buckets are all-reduced then, each launched
as soon as every gradient in it (and in every earlier bucket) has arrived, overlapping the rest of the backward.
With main gradients (`mlplat.parallel.main_params`: Megatron-style mixed precision, the distributed optimizer)
the same readiness drives the reduction of the flat main-gradient buckets instead: all-reduced, or
reduce-scattered into each rank's shard.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn

from mlplat.parallel.buckets import BUCKET_BYTES
from mlplat.parallel.grid import ParallelGrid

if TYPE_CHECKING:
    from mlplat.parallel.main_params import MainParams



def backward_buckets(chunks: dict[int, nn.Module], bucket_bytes: int,
                     alone: Iterable[nn.Parameter] = ()) -> list[tuple[int, list[nn.Parameter]]]:
    """(chunk, parameters) of each bucket, in backward order: later chunks first, and within a chunk the
    parameters in reverse, cut when a bucket reaches `bucket_bytes`. A parameter of `alone` (the tied word
    embedding) gets a bucket of its own, so that both stages holding it lay it out alike."""
    alone_ids = {id(p) for p in alone}
    out: list[tuple[int, list[nn.Parameter]]] = []
    for c in sorted(chunks, reverse=True):
        params = [p for p in chunks[c].parameters() if p.requires_grad]
        current: list[nn.Parameter] = []
        size = 0
        for p in reversed(params):
            if id(p) in alone_ids:
                out.append((c, [p]))
                continue
            current.append(p)
            size += p.numel() * p.element_size()
            if size >= bucket_bytes:
                out.append((c, current))
                current, size = [], 0
        if current:
            out.append((c, current))
    return out


class DataParallelGrads:
    """Average gradients over the data-parallel group, bucketed per model chunk, overlapped with backward.

    Use: `begin_step()`; the pipeline engine calls `before_backward(chunk, micro_batch, is_last)` before each
    backward; `finish()` after the schedule waits for the reductions (and reduces anything not yet launched).
    With `main` (main gradients), each gradient autograd delivers is first added into its fp32 (or the run's)
    main gradient and dropped, and the buckets reduced are `main`'s flat main-gradient buffers.
    """

    def __init__(self, chunks: dict[int, nn.Module], grid: ParallelGrid, bucket_bytes: int = BUCKET_BYTES,
                 overlap: bool = True, main: "MainParams | None" = None):
        self.grid, self.overlap, self.main = grid, overlap, main
        self.group = grid.dp_group
        if main is not None:  # main owns the buckets: its flat buffers are laid out along them
            layout = [(b.chunk, [s.param for s in b.slots]) for b in main.buckets]
        else:
            layout = backward_buckets(chunks, bucket_bytes)
        self.buckets: list[list[nn.Parameter]] = [params for _, params in layout]
        self.bucket_of: dict[int, int] = {}
        self.chunk_of: dict[int, int] = {}
        for i, (c, bucket) in enumerate(layout):
            for p in bucket:
                self.bucket_of[id(p)] = i
                self.chunk_of[id(p)] = c
        self._hooks = []
        # Main gradients need the hook even without data parallelism: it moves each micro-batch's gradient in.
        if main is not None or (self.group is not None and overlap):
            for bucket in self.buckets:
                for p in bucket:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))
        self.begin_step()

    @property
    def active(self) -> bool:
        return self.group is not None

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def begin_step(self) -> None:
        self._final_chunks: set[int] = set()
        self._ready = [0] * len(self.buckets)
        self._launched = 0
        self._works: list = []

    def before_backward(self, chunk: int, micro_batch: int, is_last: bool) -> None:
        if is_last:
            self._final_chunks.add(chunk)

    def grad_ready(self, p: torch.Tensor) -> None:
        """A gradient accumulated outside autograd (the zero-bubble W step) is final: count it like a hook."""
        if self._hooks:
            self._on_grad(p)

    def _on_grad(self, p: torch.Tensor) -> None:
        if self.main is not None:
            self.main.accumulate(p)
        if self.group is None or not self.overlap or self.chunk_of[id(p)] not in self._final_chunks:
            return  # an earlier micro-batch: keep accumulating locally
        i = self.bucket_of[id(p)]
        self._ready[i] += 1
        # Launch in bucket order so every data-parallel rank issues the same sequence of collectives.
        while self._launched < len(self.buckets) and self._ready[self._launched] == len(self.buckets[self._launched]):
            self._launch(self._launched)
            self._launched += 1

    def _launch(self, i: int) -> None:
        if self.main is not None:
            self._works.append((i, None, self.main.reduce(i)))
            return
        bucket = self.buckets[i]
        for p in bucket:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in bucket])
        flat.div_(self.grid.dp)
        self._works.append((i, flat, dist.all_reduce(flat, group=self.group, async_op=True)))

    def finish(self) -> None:
        if not self.active:
            return
        while self._launched < len(self.buckets):  # not overlapped (overlap off, or unused parameters)
            self._launch(self._launched)
            self._launched += 1
        for i, flat, work in self._works:
            work.wait()
            if flat is None:
                self.main.reduced(i)
                continue
            offset = 0
            for p in self.buckets[i]:
                n = p.numel()
                p.grad.copy_(flat[offset: offset + n].view_as(p.grad))
                offset += n
        self.begin_step()


def reduce_tied_grads(params: Iterable[nn.Parameter], grid: ParallelGrid) -> None:
    """Sum the gradient of the tied word embedding between the first and the last pipeline stage."""
    if grid.embedding_group is None:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, group=grid.embedding_group)


def counted_once(p: nn.Parameter, grid: ParallelGrid) -> bool:
    """Count each full-model parameter once: replicated-across-tp ones on tp rank 0 only, the tied embedding's
    copy on the last stage not at all."""
    if getattr(p, "shared_copy", False):
        return False
    return getattr(p, "partition_dim", None) is not None or grid.tp_rank == 0


def grad_norm(params: Iterable[nn.Parameter], grid: ParallelGrid) -> torch.Tensor:
    """The L2 norm of the full model's gradient (call after data-parallel and tied reductions)."""
    params = [p for p in params if p.grad is not None]
    device = params[0].grad.device if params else torch.device("cpu")
    dtype = torch.float64 if params and params[0].grad.dtype == torch.float64 else torch.float32
    sq = torch.zeros((), dtype=dtype, device=device)
    for p in params:
        if counted_once(p, grid):
            sq += p.grad.detach().to(dtype).pow(2).sum()
    if grid.model_parallel_group is not None:
        dist.all_reduce(sq, group=grid.model_parallel_group)
    return sq.sqrt()


def clip_grad_norm_(params: Iterable[nn.Parameter], grid: ParallelGrid, max_norm: float) -> torch.Tensor:
    """Scale all gradients so the full model's gradient norm is at most max_norm; returns the norm before."""
    params = [p for p in params if p.grad is not None]
    norm = grad_norm(params, grid)
    if max_norm > 0 and math.isfinite(float(norm)):
        coef = max_norm / (float(norm) + 1e-6)
        if coef < 1.0:
            for p in params:
                p.grad.mul_(coef)
    return norm
