"""The collective mappings between parallel regions, on one set of `(x, dim, group)` helpers.

Tensor parallelism (Shoeybi et al., 2019; Narayanan et al., SC21, §2.3) enters and leaves its region with the
conjugate pair f / g (`copy_to_tensor_parallel`: identity forward, all-reduce backward;
`reduce_from_tensor_parallel`: the reverse), and splits or gathers the last dim where a layer's input or output
is sharded (`scatter_to_tensor_parallel`, `gather_from_tensor_parallel`). Sequence parallelism (Korthikanti et
al., 2022, §4.2.2) replaces f / g by an all-gather and a reduce-scatter along the sequence
(`all_gather_from_sequence_parallel`, `reduce_scatter_to_sequence_parallel`; the all-gather composed with a
column-parallel GEMM is `mlplat.parallel.linear`). Each mapping's backward is the conjugate collective on
the gradient. Activations are [b, s, h]: the sequence is `SEQUENCE_DIM`.

A grid without process groups (virtual mode, tp > 1: meta-device planning) keeps the shapes right without
communicating: a split slices, a gather repeats the local part, a reduction is the identity.

Every collective is looked up in `torch.distributed` at each call, never bound at import: the profiler replaces
them there while it records (`mlplat.parallel.profile`). torch 2.13 renamed reduce_scatter_tensor /
all_gather_into_tensor (deprecated there) to reduce_scatter_single / all_gather_single, the same collectives;
older torch has only the former names.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from mlplat.parallel.grid import ParallelGrid

SEQUENCE_DIM = 1  # activations are [batch, sequence, hidden]


# ---------------------------------------------------------------------------------------- flat collectives


def reduce_scatter_into(output: Tensor, source: Tensor, group, async_op: bool = False):
    """output = this rank's 1/t slice (along dim 0) of the sum of `source` over `group`; the work when async_op."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, source, group=group, async_op=async_op)


def all_gather_into(output: Tensor, source: Tensor, group, async_op: bool = False):
    """output = the `source` of every rank of `group`, concatenated along dim 0; the work when async_op."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, source, group=group, async_op=async_op)


# ---------------------------------------------------------------------------------------- (x, dim, group)


def _divisible(x: Tensor, dim: int, t: int) -> int:
    if x.shape[dim] % t:
        raise ValueError(f"dim {dim} of shape {tuple(x.shape)} ({x.shape[dim]}) is not divisible by the group's "
                         f"size {t}")
    return x.shape[dim] // t


def split(x: Tensor, dim: int, group) -> Tensor:
    """This rank's 1/t of `x` along `dim` (contiguous: it is handed to collectives and saved for backward)."""
    t = dist.get_world_size(group)
    size = _divisible(x, dim, t)
    return x.narrow(dim, dist.get_rank(group) * size, size).contiguous()


def all_reduce(x: Tensor, group) -> Tensor:
    """The sum of `x` over `group`, in a new tensor: all_reduce is in place, and autograd (or the caller) may
    still hold `x`."""
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, group=group)
    return out


class Pending:
    """A started collective: `wait()` waits for it, `result()` returns its result (waiting first if need be).
    Holds the send buffer until the wait (NCCL reads it asynchronously, so it must outlive the call that posted
    it). The two steps apart let a caller post its next collective before it pays for this one's copy."""

    def __init__(self, work, finish, keep=None):
        self._work, self._finish, self._keep = work, finish, keep

    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()
        self._work, self._keep = None, None

    def result(self) -> Tensor:
        self.wait()
        return self._finish()


def start_all_gather(x: Tensor, dim: int, group, async_op: bool = True) -> Pending:
    """The concatenation along `dim` of every rank's `x`. Along dim 0 the ranks' parts land in place, one buffer
    and no copy; along another dim they are interleaved, which costs one copy whatever collective lands them, so
    the list all-gather fills t buffers that one cat joins."""
    t = dist.get_world_size(group)
    dim = dim % x.dim()
    x = x.contiguous()
    if dim == 0:
        out = x.new_empty((t * x.shape[0], *x.shape[1:]))
        return Pending(all_gather_into(out, x, group, async_op=async_op), lambda: out, keep=x)
    parts = [torch.empty_like(x) for _ in range(t)]
    work = dist.all_gather(parts, x, group=group, async_op=async_op)
    return Pending(work, lambda: torch.cat(parts, dim=dim), keep=x)


def all_gather(x: Tensor, dim: int, group) -> Tensor:
    return start_all_gather(x, dim, group, async_op=False).result()


def start_reduce_scatter(x: Tensor, dim: int, group, async_op: bool = True) -> Pending:
    """This rank's 1/t along `dim` of the sum of `x` over `group`. The single-tensor reduce-scatter splits dim 0:
    along dim 0 `x` is sent as it is; along another dim its t slices are first moved to the front (one copy)."""
    t = dist.get_world_size(group)
    dim = dim % x.dim()
    size = _divisible(x, dim, t)
    shape = (*x.shape[:dim], size, *x.shape[dim + 1:])
    if dim == 0:
        source = x.contiguous()
    else:
        source = x.reshape(*x.shape[:dim], t, size, *x.shape[dim + 1:]).movedim(dim, 0).contiguous()
        source = source.view(t * shape[0], *shape[1:])
    out = x.new_empty(shape)
    return Pending(reduce_scatter_into(out, source, group, async_op=async_op), lambda: out, keep=source)


def reduce_scatter(x: Tensor, dim: int, group) -> Tensor:
    return start_reduce_scatter(x, dim, group, async_op=False).result()


# ---------------------------------------------------------------------------------------- autograd functions


class _AllReduceBackward(torch.autograd.Function):
    """Identity forward, the gradient summed over the group backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad, ctx.group), None


class _AllReduceForward(torch.autograd.Function):
    """Summed over the group forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _along_dim(name: str, forward: Callable, backward: Callable, doc: str) -> type[torch.autograd.Function]:
    """An autograd function applying `forward(x, dim, group)` and, to the gradient, `backward(grad, dim, group)`."""

    def fwd(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return forward(x, dim, group)

    def bwd(ctx, grad):
        return backward(grad, ctx.dim, ctx.group), None, None

    return type(name, (torch.autograd.Function,), {"__doc__": doc, "forward": staticmethod(fwd),
                                                   "backward": staticmethod(bwd)})


_Split = _along_dim("_Split", split, all_gather, "This rank's part along `dim` forward; the gradient all-gathered.")
_Gather = _along_dim("_Gather", all_gather, split, "All-gathered along `dim` forward; the gradient split back.")
_ReduceScatter = _along_dim("_ReduceScatter", reduce_scatter, all_gather,
                            "Reduce-scattered along `dim` forward; the gradient all-gathered backward.")
_GatherReduceScatter = _along_dim("_GatherReduceScatter", all_gather, reduce_scatter,
                                  "All-gathered along `dim` forward; the gradient reduce-scattered backward.")


# ---------------------------------------------------------------------------------------- the mappings


def _virtual_split(x: Tensor, dim: int, grid: ParallelGrid) -> Tensor:
    size = _divisible(x, dim, grid.tp)
    return x.narrow(dim, grid.tp_rank * size, size).contiguous()


def copy_to_tensor_parallel(x: Tensor, grid: ParallelGrid) -> Tensor:
    """f: identity forward; sums the gradient over the tensor-parallel ranks backward."""
    if grid.tp == 1 or grid.tp_group is None:
        return x
    return _AllReduceBackward.apply(x, grid.tp_group)


def reduce_from_tensor_parallel(x: Tensor, grid: ParallelGrid) -> Tensor:
    """g: sums partial results over the tensor-parallel ranks forward; identity backward."""
    if grid.tp == 1 or grid.tp_group is None:
        return x
    return _AllReduceForward.apply(x, grid.tp_group)


def scatter_to_tensor_parallel(x: Tensor, grid: ParallelGrid) -> Tensor:
    """Keeps this rank's slice of the last dim forward; all-gathers the gradient backward."""
    if grid.tp == 1:
        return x
    if grid.tp_group is None:
        return _virtual_split(x, -1, grid)
    return _Split.apply(x, -1, grid.tp_group)


def gather_from_tensor_parallel(x: Tensor, grid: ParallelGrid) -> Tensor:
    """All-gathers along the last dim forward; keeps this rank's slice of the gradient backward."""
    if grid.tp == 1:
        return x
    if grid.tp_group is None:
        return torch.cat([x] * grid.tp, dim=-1)
    return _Gather.apply(x, -1, grid.tp_group)


def reduce_scatter_to_sequence_parallel(x: Tensor, grid: ParallelGrid) -> Tensor:
    """ḡ: partial sums over the whole sequence -> this rank's shard of their sum; all-gathers the gradient."""
    if grid.tp == 1:
        return x
    if grid.tp_group is None:
        return _virtual_split(x, SEQUENCE_DIM, grid)
    return _ReduceScatter.apply(x, SEQUENCE_DIM, grid.tp_group)


def all_gather_from_sequence_parallel(x: Tensor, grid: ParallelGrid) -> Tensor:
    """g: this rank's sequence shard -> the whole sequence; reduce-scatters the gradient (every rank's use of the
    whole sequence contributes to each shard's gradient)."""
    if grid.tp == 1:
        return x
    if grid.tp_group is None:
        return torch.cat([x] * grid.tp, dim=SEQUENCE_DIM)
    return _GatherReduceScatter.apply(x, SEQUENCE_DIM, grid.tp_group)


def scatter_to_sequence_parallel(x: Tensor, grid: ParallelGrid) -> Tensor:
    """The whole sequence, the same on every tp rank -> this rank's shard; the gradient all-gathered (each rank's
    shard's gradient is the whole sequence's there). Expert parallelism routes each rank's shard of a replicated
    sequence (`mlplat.model.moe`)."""
    if grid.tp == 1:
        return x
    if grid.tp_group is None:
        return _virtual_split(x, SEQUENCE_DIM, grid)
    return _Split.apply(x, SEQUENCE_DIM, grid.tp_group)


def gather_from_sequence_parallel(x: Tensor, grid: ParallelGrid) -> Tensor:
    """This rank's sequence shard -> the whole sequence, used the same way on every tp rank afterwards; the gradient
    split (not reduce-scattered: every rank's use is the same use, counted once)."""
    if grid.tp == 1:
        return x
    if grid.tp_group is None:
        return torch.cat([x] * grid.tp, dim=SEQUENCE_DIM)
    return _Gather.apply(x, SEQUENCE_DIM, grid.tp_group)


def gather_rows(x: Tensor, group) -> Tensor:
    """The group's rows x concatenated along dim 0; the gradient reduce-scattered back (every rank used them)."""
    return _GatherReduceScatter.apply(x, 0, group)


def reduce_scatter_rows(x: Tensor, group) -> Tensor:
    """This rank's 1/n of the rows of the sum of x over the group; the gradient all-gathered."""
    return _ReduceScatter.apply(x, 0, group)
