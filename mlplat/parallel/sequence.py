"""Sequence parallelism (Korthikanti et al., 2022, *Reducing Activation Recomputation in Large Transformer
Models*, §4.2.2).

Tensor parallelism leaves LayerNorm, dropout and the residual adds replicated on the t ranks of a stage: each
holds the whole [b, s, h] activation there, 10·sbh of a layer's 34·sbh bytes. Sequence parallelism splits those
regions along the sequence instead: tensor-parallel rank i holds tokens [i·s/t, (i+1)·s/t). At the edges of the
tensor-parallel regions the conjugate pair g / ḡ replaces tensor parallelism's all-reduces (the SC21 paper's f / g):

- g, before a column-parallel GEMM: all-gather along the sequence forward, reduce-scatter backward
  (`linear_with_sequence_gather`, here: it keeps only the input's shard for backward and gathers it again there,
  overlapped with the input-gradient GEMM);
- ḡ, after a row-parallel GEMM: reduce-scatter along the sequence forward, all-gather backward
  (`mlplat.parallel.mappings.reduce_scatter_to_sequence_parallel`, beside the other mappings).

An all-gather plus a reduce-scatter move the bytes of one all-reduce, so the communication volume is unchanged.

Parameters applied to the shard (LayerNorms, the row-parallel biases, the position embedding) see only this
rank's tokens, so their gradients are partial sums over the sequence: they carry `sequence_parallel_replicated`
and the gradient buffer all-reduces them over the tensor-parallel group after the backward
(`mlplat.parallel.data_parallel.DataParallelGrads.reduce_sequence_parallel`).

Activations are [batch, sequence, hidden]: the sequence is `mappings.SEQUENCE_DIM`.
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mlplat.parallel.grid import ParallelGrid
from mlplat.parallel.mappings import (
    SEQUENCE_DIM,
    all_gather,
    all_gather_from_sequence_parallel,
    start_all_gather,
    start_reduce_scatter,
)
from mlplat.parallel.weight_grad import weight_and_bias_grads

# ---------------------------------------------------------------------------------------- g + GEMM


class _SequenceGatherLinear(torch.autograd.Function):
    """Y = gather(X)·Wᵀ + b, saving X's shard rather than the gathered input (1/t of the bytes): backward
    gathers it again while the input-gradient GEMM runs, and reduce-scatters the input gradient while the
    weight-gradient GEMM runs. With a `store` (zero-bubble B) the weight GEMM is deferred to W with the gathered
    input (mlplat.parallel.weight_grad)."""

    @staticmethod
    def forward(ctx, x, weight, bias, grid: ParallelGrid, store):
        ctx.save_for_backward(x, weight)
        ctx.grid, ctx.store, ctx.has_bias = grid, store, bias is not None
        return F.linear(all_gather(x, SEQUENCE_DIM, grid.tp_group), weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        group = ctx.grid.tp_group
        gathering = start_all_gather(x, SEQUENCE_DIM, group)
        grad_full = grad_out.matmul(weight.to(grad_out.dtype))
        gathering.wait()
        scattering = start_reduce_scatter(grad_full, SEQUENCE_DIM, group)
        grad_w, grad_b = weight_and_bias_grads(weight, gathering.result(), grad_out, ctx.has_bias, ctx.store)
        return scattering.result().to(x.dtype), grad_w, grad_b, None, None


def linear_with_sequence_gather(x: Tensor, weight: Tensor, bias: Tensor | None, grid: ParallelGrid,
                                store=None) -> Tensor:
    """F.linear(x all-gathered along the sequence, weight, bias): g then a column-parallel GEMM, keeping only x's
    shard for backward."""
    if grid.tp == 1:
        return F.linear(x, weight, bias)
    if grid.tp_group is None or not torch.is_grad_enabled():
        return F.linear(all_gather_from_sequence_parallel(x, grid), weight, bias)
    return _SequenceGatherLinear.apply(x, weight, bias, grid, store)


# ---------------------------------------------------------------------------------------- gradients


def mark_sequence_parallel_replicated(*params: nn.Parameter | None) -> None:
    """Tag parameters applied to the sequence shard: their gradients are summed over the tp group."""
    for p in params:
        if p is not None:
            p.sequence_parallel_replicated = True  # type: ignore[attr-defined]


def sequence_parallel_replicated(params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
    return [p for p in params if getattr(p, "sequence_parallel_replicated", False) and p.requires_grad]
