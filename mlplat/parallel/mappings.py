"""Collectives on flat tensors, shared by every caller that reduce-scatters or all-gathers one buffer.

torch 2.13 renamed reduce_scatter_tensor / all_gather_into_tensor (deprecated there) to reduce_scatter_single /
all_gather_single (the same collectives); older torch has only the former. Both are looked up in
`torch.distributed` at each call, never bound at import: the profiler replaces them there while it records
(`mlplat.parallel.profile`).
"""
from __future__ import annotations

import torch.distributed as dist
from torch import Tensor


def reduce_scatter_into(output: Tensor, source: Tensor, group, async_op: bool = False):
    """output = this rank's 1/t slice (along dim 0) of the sum of `source` over `group`; the work when async_op."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, source, group=group, async_op=async_op)


def all_gather_into(output: Tensor, source: Tensor, group, async_op: bool = False):
    """output = the `source` of every rank of `group`, concatenated along dim 0; the work when async_op."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, source, group=group, async_op=async_op)
