"""Sequence parallelism (Korthikanti et al., 2022, *Reducing Activation Recomputation in Large Transformer
Models*, §4.2.2).

Tensor parallelism leaves LayerNorm, dropout and the residual adds replicated on the t ranks of a stage: each
holds the whole [b, s, h] activation there, 10·sbh of a layer's 34·sbh bytes. Sequence parallelism splits those
regions along the sequence instead: tensor-parallel rank i holds tokens [i·s/t, (i+1)·s/t). At the edges of the
tensor-parallel regions the conjugate pair g / ḡ replaces tensor parallelism's all-reduces (the SC21 paper's f / g):

- g, before a column-parallel GEMM: all-gather along the sequence forward, reduce-scatter backward (composed
  with the GEMM in `mlplat.parallel.linear.linear(..., sequence_gather=grid)`, the model's one GEMM path: it keeps
  only the input's shard for backward and gathers it again there, overlapped with the input-gradient GEMM);
- ḡ, after a row-parallel GEMM: reduce-scatter along the sequence forward, all-gather backward
  (`mlplat.parallel.mappings.reduce_scatter_to_sequence_parallel`, beside the other mappings).

An all-gather plus a reduce-scatter move the bytes of one all-reduce, so the communication volume is unchanged.

Parameters applied to the shard (LayerNorms, the row-parallel biases, the position embedding) see only this
rank's tokens, so their gradients are partial sums over the sequence: they carry `sequence_parallel_replicated`
and the gradient buffer all-reduces them over the tensor-parallel group after the backward
(`mlplat.optim.buffers.ParamBuffers.reduce_sequence_parallel`).

Activations are [batch, sequence, hidden]: the sequence is `mappings.SEQUENCE_DIM`.
"""
from __future__ import annotations

from typing import Iterable

from torch import nn

# ---------------------------------------------------------------------------------------- gradients


def mark_sequence_parallel_replicated(*params: nn.Parameter | None) -> None:
    """Tag parameters applied to the sequence shard: their gradients are summed over the tp group."""
    for p in params:
        if p is not None:
            p.sequence_parallel_replicated = True  # type: ignore[attr-defined]


def sequence_parallel_replicated(params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
    return [p for p in params if getattr(p, "sequence_parallel_replicated", False) and p.requires_grad]
