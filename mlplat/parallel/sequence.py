"""Sequence parallelism (Korthikanti et al., 2022, *Reducing Activation Recomputation in Large Transformer
Models*, §4.2.2).

Tensor parallelism leaves LayerNorm, dropout and the residual adds replicated on the t ranks of a stage: each
holds the whole [b, s, h] activation there, 10·sbh of a layer's 34·sbh bytes. Sequence parallelism splits those
regions along the sequence instead: tensor-parallel rank i holds tokens [i·s/t, (i+1)·s/t). At the edges of the
tensor-parallel regions the conjugate pair g / ḡ replaces tensor parallelism's all-reduces (the SC21 paper's f / g,
`mlplat.parallel.tensor`):

- g, before a column-parallel GEMM: all-gather along the sequence forward, reduce-scatter backward
  (`linear_with_sequence_gather`, which keeps only the input's shard for backward and gathers it again there);
- ḡ, after a row-parallel GEMM: reduce-scatter along the sequence forward, all-gather backward
  (`reduce_scatter_to_sequence_parallel`).

An all-gather plus a reduce-scatter move the bytes of one all-reduce, so the communication volume is unchanged.

Parameters applied to the shard (LayerNorms, the row-parallel biases, the position embedding) see only this
rank's tokens, so their gradients are partial sums over the sequence: they carry `sequence_parallel_replicated`
and `reduce_sequence_parallel_grads` all-reduces them over the tensor-parallel group after the backward.

Activations are [batch, sequence, hidden]: the sequence is dim 1.
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from mlplat.parallel.grid import ParallelGrid

SEQ_DIM = 1


def _reduce_scatter_single(output: Tensor, source: Tensor, group, async_op: bool):
    # Looked up at each call, never bound at import: the profiler times the collectives of torch.distributed while
    # it records (mlplat.parallel.profile). torch 2.13 renamed reduce_scatter_tensor (deprecated there) to
    # reduce_scatter_single; gloo has both since 2.3.
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, source, group=group, async_op=async_op)


def _check(x: Tensor, grid: ParallelGrid) -> None:
    if x.shape[SEQ_DIM] % grid.tp:
        raise ValueError(f"sequence length {x.shape[SEQ_DIM]} is not divisible by tp={grid.tp}")


def _split(x: Tensor, grid: ParallelGrid) -> Tensor:
    _check(x, grid)
    size = x.shape[SEQ_DIM] // grid.tp
    return x.narrow(SEQ_DIM, grid.tp_rank * size, size).contiguous()


def _start_all_gather(x: Tensor, grid: ParallelGrid, async_op: bool = False):
    """(parts, work): the t shards land in `parts` once `work` is waited for (None when not async)."""
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(grid.tp)]
    return parts, dist.all_gather(parts, x, group=grid.tp_group, async_op=async_op)


def _all_gather(x: Tensor, grid: ParallelGrid) -> Tensor:
    if grid.tp_group is None:  # virtual grid (meta-device planning): shapes only
        return torch.cat([x] * grid.tp, dim=SEQ_DIM)
    parts, _ = _start_all_gather(x, grid)
    return torch.cat(parts, dim=SEQ_DIM)


def _start_reduce_scatter(x: Tensor, grid: ParallelGrid, async_op: bool = False):
    """(out, work, send buffer): this rank's sequence slice of the sum over the group, valid once `work` is
    waited for (the send buffer must live until then)."""
    _check(x, grid)
    b, s = x.shape[0], x.shape[SEQ_DIM]
    # The single-tensor reduce-scatter splits dim 0: put the t sequence slices first ([t·b, s/t, ...]).
    rest = x.shape[2:]
    stacked = x.reshape(b, grid.tp, s // grid.tp, *rest).transpose(0, 1).reshape(grid.tp * b, s // grid.tp, *rest)
    stacked = stacked.contiguous()
    out = torch.empty((b, s // grid.tp, *rest), dtype=x.dtype, device=x.device)
    return out, _reduce_scatter_single(out, stacked, group=grid.tp_group, async_op=async_op), stacked


def _reduce_scatter(x: Tensor, grid: ParallelGrid) -> Tensor:
    if grid.tp_group is None:
        return _split(x, grid)
    return _start_reduce_scatter(x, grid)[0]


# ---------------------------------------------------------------------------------------- mappings


class _ReduceScatterToSequenceParallel(torch.autograd.Function):
    """ḡ: reduce-scatter along the sequence forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x, grid: ParallelGrid):
        ctx.grid = grid
        return _reduce_scatter(x, grid)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.grid), None


def reduce_scatter_to_sequence_parallel(x: Tensor, grid: ParallelGrid) -> Tensor:
    """ḡ: partial sums over the whole sequence -> this rank's shard of their sum (all-gathers the gradient)."""
    return _ReduceScatterToSequenceParallel.apply(x, grid) if grid.tp > 1 else x


# ---------------------------------------------------------------------------------------- g + GEMM


class _SequenceGatherLinear(torch.autograd.Function):
    """Y = gather(X)·Wᵀ + b, saving X's shard rather than the gathered input (1/t of the bytes): backward
    gathers it again, while the input-gradient GEMM runs, and reduce-scatters the input gradient while the
    weight-gradient GEMM runs. With a `store` (zero-bubble B) the weight GEMM is deferred to W with the gathered
    input (mlplat.parallel.weight_grad)."""

    @staticmethod
    def forward(ctx, x, weight, bias, grid: ParallelGrid, store):
        ctx.save_for_backward(x, weight)
        ctx.grid, ctx.store, ctx.has_bias = grid, store, bias is not None
        return F.linear(_all_gather(x, grid), weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grid = ctx.grid
        parts, gathering = _start_all_gather(x, grid, async_op=True)
        grad_full = grad_out.matmul(weight.to(grad_out.dtype))
        gathering.wait()
        grad_x, scattering, _sending = _start_reduce_scatter(grad_full, grid, async_op=True)
        full = torch.cat(parts, dim=SEQ_DIM)
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        grad_b = g2.sum(0) if ctx.has_bias else None
        grad_w = None
        if ctx.store is not None and ctx.store.key is not None:
            ctx.store.record(weight, full, grad_out.detach())
        else:
            grad_w = g2.t().mm(full.reshape(-1, full.shape[-1]).to(g2.dtype)).to(weight.dtype)
        scattering.wait()
        return grad_x.to(x.dtype), grad_w, grad_b, None, None


def linear_with_sequence_gather(x: Tensor, weight: Tensor, bias: Tensor | None, grid: ParallelGrid,
                                store=None) -> Tensor:
    """F.linear(x all-gathered along the sequence, weight, bias): g then a column-parallel GEMM, keeping only x's
    shard for backward."""
    if grid.tp == 1:
        return F.linear(x, weight, bias)
    if grid.tp_group is None or not torch.is_grad_enabled():
        return F.linear(_all_gather(x, grid), weight, bias)
    return _SequenceGatherLinear.apply(x, weight, bias, grid, store)


# ---------------------------------------------------------------------------------------- gradients


def mark_sequence_parallel_replicated(*params: nn.Parameter | None) -> None:
    """Tag parameters applied to the sequence shard: their gradients are summed over the tp group."""
    for p in params:
        if p is not None:
            p.sequence_parallel_replicated = True  # type: ignore[attr-defined]


def sequence_parallel_replicated(params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
    return [p for p in params if getattr(p, "sequence_parallel_replicated", False) and p.requires_grad]


def reduce_sequence_parallel_grads(params: Iterable[nn.Parameter], grid: ParallelGrid) -> None:
    """Sum the gradients of the parameters applied to the sequence shard over the tensor-parallel group, in one
    flat all-reduce. Forgetting it passes at t = 1 and drifts at t > 1: each rank would step with the gradient
    of its own tokens only."""
    params = list(params)
    if grid.tp_group is None or not params:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat, group=grid.tp_group)
    offset = 0
    for p in params:
        n = p.numel()
        p.grad.copy_(flat[offset: offset + n].view_as(p.grad))
        offset += n
