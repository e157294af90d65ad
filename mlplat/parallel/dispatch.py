"""Expert parallelism's token dispatch (Lepikhin et al., GShard, 2020; Megatron-Core's token dispatchers): each rank
holds E/ep whole experts; a rank's routed assignments reach the ranks of their experts and their outputs come back.

Two dispatchers, equal in what they compute (each equal to one process in tests/parallel/test_moe.py and
tests/cli/test_train.py):

- `alltoall`: the assignments, sorted by expert, go to their experts' ranks in one all-to-all with uneven splits,
  their gates in a second (the experts weigh their activation by them, mlplat.model.moe), and the outputs come
  back in a third (the reverse three in backward). The split sizes are data: each rank first sends
  every other rank its counts per local expert (a small all-to-all), and the host reads both sides' sizes once per
  layer per micro-batch (`Tensor.tolist`: on a GPU a synchronisation of the current stream with the host, never a
  device-wide one, so the pipeline's posted transfers on their own streams are untouched; docs/gpu-nccl.md).
- `allgather`: every rank all-gathers the ep group's tokens and their routing, runs its own experts on the
  assignments that chose them, and a reduce-scatter returns to each rank the sum of the outputs for its tokens.
  Equal-sized collectives, no host read; ep times the tokens on every rank.

Both take the assignments a rank kept (capacity applies to the rank's own tokens before dispatch) and hand back,
for each, the weighted output (alltoall) or the combined rows (allgather). The collectives are looked up in
torch.distributed at each call (the profiler and the hang watch wrap them there).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from mlplat.parallel.mappings import gather_rows, reduce_scatter_rows

# What one MoE layer posts on its ep group per micro-batch, in order, as (what, kind of collective): the transport
# model runs these beside the pipeline's transfers for every schedule (`exchange.with_stage_collectives`,
# tests/perf/test_transport.py) and tests/parallel/test_moe.py records them on a run. The host waits for alltoall's
# first (the split sizes); the backward's order is autograd's (the later-created of two ready nodes first).
COLLECTIVES = {
    "alltoall": {"forward": (("counts", "all_to_all"), ("tokens", "all_to_all"), ("gates", "all_to_all"),
                             ("outputs", "all_to_all")),
                 "backward": (("outputs", "all_to_all"), ("gates", "all_to_all"), ("tokens", "all_to_all"))},
    "allgather": {"forward": (("tokens", "all_gather"), ("experts", "all_gather"), ("gates", "all_gather"),
                              ("outputs", "reduce_scatter")),
                  "backward": (("outputs", "all_gather"), ("gates", "reduce_scatter"), ("tokens", "reduce_scatter"))},
}


class _AllToAll(torch.autograd.Function):
    """Rows of x sent in `send` sized pieces to the group's ranks, `recv` sized pieces received; the gradient takes
    the way back."""

    @staticmethod
    def forward(ctx, x: Tensor, send: list[int], recv: list[int], group) -> Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        back = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return back, None, None, None


def exchange_counts(counts: Tensor, ep: int, group) -> tuple[Tensor, list[int], list[int]]:
    """counts [E] (this rank's kept assignments per global expert, rank j's experts the j-th E/ep) -> (received
    [ep, E/ep]: what each rank sends this rank's experts, the rows this rank sends each rank, the rows it receives
    from each): one small all-to-all and one host read."""
    mine = counts.view(ep, -1)
    received = torch.empty_like(mine)
    dist.all_to_all_single(received, mine.contiguous(), group=group)
    sizes = torch.cat([mine.sum(1), received.sum(1)]).tolist()  # the one host read of the split sizes
    return received, sizes[:ep], sizes[ep:]


def alltoall_experts(x: Tensor, gate: Tensor, counts: Tensor, experts: Callable[[Tensor, Tensor, Tensor], Tensor],
                     ep: int, group) -> Tensor:
    """Rows x [M, h] sorted by global expert (`counts` [E] per expert), with their gates [M], through their
    experts, wherever they live: the weighted outputs [M, h] in x's order. `experts(rows, gates, counts_local)`
    runs this rank's E/ep experts on rows sorted by local expert. The gates travel in an all-to-all of their own
    (they are the router's dtype, not the tokens')."""
    received, send, recv = exchange_counts(counts, ep, group)
    rows = _AllToAll.apply(x, send, recv, group)  # ordered by source rank, then by local expert
    gates = _AllToAll.apply(gate, send, recv, group)
    local = received.shape[1]
    # Regroup by local expert (source order kept within one): the grouped GEMM wants each expert's rows together.
    segment = torch.arange(ep * local, device=x.device).repeat_interleave(received.reshape(-1),
                                                                        output_size=rows.shape[0])
    order = torch.argsort(segment % local * ep + segment // local, stable=True)
    out = experts(rows[order], gates[order], received.sum(0))
    back = torch.empty_like(order)
    back[order] = torch.arange(order.numel(), device=order.device)
    return _AllToAll.apply(out[back], recv, send, group)


def allgather_experts(tokens: Tensor, expert: Tensor, gate: Tensor,
                      experts: Callable[[Tensor, Tensor, Tensor], Tensor], first: int, local: int, group) -> Tensor:
    """tokens [N, h] of this rank; expert [N, k] each assignment's global expert (-1: dropped) and gate [N, k] its
    weight. The ep group's tokens and assignments all-gathered, this rank's experts [first, first + local) run on
    those that chose them, their weighted outputs summed per token and reduce-scattered back: [N, h], every
    expert's contribution to this rank's tokens."""
    every = gather_rows(tokens, group)
    chosen = _gather_plain(expert, group).reshape(-1)
    weight = gather_rows(gate, group).reshape(-1)
    k = expert.shape[1]
    mine = ((chosen >= first) & (chosen < first + local)).nonzero().squeeze(1)
    e = chosen[mine] - first
    order = torch.argsort(e, stable=True)
    assignment = mine[order]
    token = assignment // k
    counts = torch.bincount(e, minlength=local)
    out = experts(every[token], weight[assignment], counts)
    combined = add_rows(every.new_zeros(every.shape), token, out)
    return reduce_scatter_rows(combined, group)


def add_rows(into: Tensor, index: Tensor, rows: Tensor) -> Tensor:
    """`into` with rows[i] added to its row index[i]: index_put's accumulation, whose backward keeps the index alone
    (index_add's keeps `rows` too: an assignment's h-wide output, which the combine must not hold)."""
    return into.index_put((index,), rows, accumulate=True)


def _gather_plain(x: Tensor, group) -> Tensor:
    """The group's x concatenated along dim 0, no gradient (indices)."""
    out = x.new_empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]))
    parts = list(out.chunk(dist.get_world_size(group)))
    dist.all_gather(parts, x.contiguous(), group=group)
    return out
