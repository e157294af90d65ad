"""Gradient reductions after the pipeline's backward: data-parallel averaging in overlapped buckets, the tied
embedding's sum between first and last stage, and the global gradient norm over the whole grid.

Data parallelism: gradients accumulate locally over the m micro-batches; only during the last micro-batch's
backward of a chunk are its parameters' gradients final, so their buckets are all-reduced then, each launched
as soon as every gradient in it (and in every earlier bucket) has arrived, overlapping the rest of the backward.
"""
from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.distributed as dist
import torch.nn as nn

from mlplat.parallel.grid import ParallelGrid


class DataParallelGrads:
    """Average gradients over the data-parallel group, bucketed per model chunk, overlapped with backward.

    Use: `begin_step()`; the pipeline engine calls `before_backward(chunk, micro_batch, is_last)` before each
    backward; `finish()` after the schedule waits for the reductions (and reduces anything not yet launched).
    """

    def __init__(self, chunks: dict[int, nn.Module], grid: ParallelGrid, bucket_bytes: int = 4 * 2**20,
                 overlap: bool = True):
        self.grid, self.overlap = grid, overlap
        self.group = grid.dp_group
        self.buckets: list[list[nn.Parameter]] = []
        self.bucket_of: dict[int, int] = {}
        self.chunk_of: dict[int, int] = {}
        # Buckets follow the backward order: later chunks first, and within a chunk the parameters in reverse.
        for c in sorted(chunks, reverse=True):
            params = [p for p in chunks[c].parameters() if p.requires_grad]
            current: list[nn.Parameter] = []
            size = 0
            for p in reversed(params):
                current.append(p)
                size += p.numel() * p.element_size()
                self.chunk_of[id(p)] = c
                if size >= bucket_bytes:
                    self.buckets.append(current)
                    current, size = [], 0
            if current:
                self.buckets.append(current)
        for i, bucket in enumerate(self.buckets):
            for p in bucket:
                self.bucket_of[id(p)] = i
        self._hooks = []
        if self.group is not None and overlap:
            for bucket in self.buckets:
                for p in bucket:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))
        self.begin_step()

    @property
    def active(self) -> bool:
        return self.group is not None

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
        if self.chunk_of[id(p)] not in self._final_chunks:
            return  # an earlier micro-batch: keep accumulating locally
        i = self.bucket_of[id(p)]
        self._ready[i] += 1
        # Launch in bucket order so every data-parallel rank issues the same sequence of collectives.
        while self._launched < len(self.buckets) and self._ready[self._launched] == len(self.buckets[self._launched]):
            self._launch(self._launched)
            self._launched += 1

    def _launch(self, i: int) -> None:
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


def _counted_once(p: nn.Parameter, grid: ParallelGrid) -> bool:
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
        if _counted_once(p, grid):
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
