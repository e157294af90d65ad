"""Cross-entropy over vocab-sharded logits, without ever gathering them.

Gathering ``[b, s, V]`` logits would cost tp times the memory of the shard and an all-gather of the
largest activation in the model. Instead each rank reduces its shard to per-token scalars and only
those are all-reduced over tp: the max (for stability), then the sum of exp and the target logit.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from mlplat.parallel.grid import ParallelGrid


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, target: Tensor, grid: ParallelGrid, vocab_size: int | None):
        group = grid.tp_group if grid.tp > 1 else None
        # Half precisions would lose the sum of exp; compute in float32 (float64 stays float64).
        work = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
        shard = work.shape[-1]
        start = grid.tp_rank * shard

        if vocab_size is not None and start + shard > vocab_size:
            # Padding columns (global id >= vocab_size) are -inf: they add nothing to the partition
            # function and get zero gradient, so tp=1,2,4 with different paddings agree exactly.
            column = torch.arange(start, start + shard, device=work.device)
            work = work.masked_fill(column >= vocab_size, float("-inf"))

        # 1. Global max per token, subtracted for stability (exp of huge logits would overflow).
        max_logit = work.detach().amax(dim=-1)
        if group is not None:
            dist.all_reduce(max_logit, op=dist.ReduceOp.MAX, group=group)
        shifted = work - max_logit.unsqueeze(-1)

        # 2. Target logit (only the rank owning the target id contributes) and sum of exp, in one all-reduce.
        outside = (target < start) | (target >= start + shard)
        local_target = (target - start).masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = shifted.exp()
        sums = torch.stack([exp.sum(dim=-1), target_logit])
        if group is not None:
            dist.all_reduce(sums, group=group)
        sum_exp, target_logit = sums[0], sums[1]

        loss = torch.log(sum_exp) - target_logit
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local_target, outside)
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        softmax, local_target, outside = ctx.saved_tensors
        # d loss / d logits = softmax - onehot(target), entirely local to the shard.
        grad = softmax.clone()
        hit = (~outside).to(grad.dtype).unsqueeze(-1)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -hit)
        grad.mul_(grad_loss.unsqueeze(-1).to(grad.dtype))
        return grad.to(ctx.logits_dtype), None, None, None


def vocab_parallel_cross_entropy(
    logits: Tensor, target: Tensor, grid: ParallelGrid, vocab_size: int | None = None
) -> Tensor:
    """Per-token loss ``[...]`` from the local vocab shard of the logits ``[..., V_pad/tp]``.

    ``target`` holds global token ids. Columns with global index >= ``vocab_size`` (the padding) are
    masked out. The loss is float32 for half-precision logits, otherwise in the logits' dtype.
    """
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and target {tuple(target.shape)} disagree")
    return _VocabParallelCrossEntropy.apply(logits, target, grid, vocab_size)
