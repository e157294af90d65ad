"""Every communicator a step uses, created during setup in an order that cannot deadlock.

ProcessGroupNCCL creates a group's communicator at the group's first operation (mlplat passes no `device_id`,
which would split every group from the world's communicator, one world-wide step per group): a store
rendezvous for NCCL's unique id, then a blocking `ncclCommInitRank`. The host waits there until every member of
the group has reached its own first operation on it. Left to the first step, the order of first uses becomes
part of the schedule: with one micro-batch per step, pipeline rank 0 first posts its early RECV_GRAD on channel
(1 -> 0) while rank 1 first posts RECV_ACT on (0 -> 1), each blocked in an initialisation the other never
reaches; and at p = 64 the warm-up walks through one rendezvous after another, stage by stage.

`create_communicators` runs one tiny operation on every group when the grid is built, before step 1:
- the collective groups, by kind in one fixed order (world, tp, the tp ranks sharing a key/value head, cp, dp,
  dp·cp, pp, embedding, file I/O).
  Each rank joins its group of each kind in that order, so the first group of the global order that is not done
  has all its members at it and completes: no deadlock. Groups of one kind are disjoint, so they initialise
  at the same time, not one after the other;
- at ep > 1, one element per rank through an all-to-all of the ep group, right after the collective groups: NCCL
  runs an all-to-all on send/receive connections between each pair of the group, made at their first use, not
  by the all-reduce, so without it the first token dispatch (`kernels.fused=false`) would connect them inside
  step 1. Whatever the dispatcher (the grid does not know it; the all-gather one needs no pair connections,
  and one element costs nothing); the ep groups are disjoint, every rank is in one, and all post it at the same
  point of this order; then the same through the node dispatcher's sub-groups of the ep group where the grid
  has them (`ParallelGrid.ep_nodes`: across the nodes, then within each), each kind disjoint;
- the directed channels of the pipeline, pair by pair in rounds (`channel_rounds`): the pairs {r, r+1} with r
  even, then those with r odd, then the wrap-around pair {p-1, 0} when p is odd, both directions of a pair in
  turn. A rank is in one pair per round, so the rounds take a constant number of rendezvous, whatever p.
  `mlplat.perf.transport` runs this order (`exchange.with_communicators`) under NCCL's host rules;
- the context-parallel ring's neighbour pairs, in the same rounds over the cp ranks.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from mlplat.parallel.layout.exchange import channel_rounds


def collective_groups(grid) -> list:
    """This rank's collective groups, one per kind, in the order every rank initialises them (None = world)."""
    kinds = [grid.tp_group, grid.kv_group, grid.cp_group, grid.dp_group, grid.pp_group, grid.embedding_group,
             grid.io_group]
    if grid.dp_cp_group is not grid.dp_group:
        kinds.insert(4, grid.dp_cp_group)
    for hsdp in (grid.shard_group, grid.replicate_group):  # parallel.dp_shard: groups of their own
        if hsdp is not None and hsdp is not grid.dp_cp_group:
            kinds.insert(kinds.index(grid.pp_group), hsdp)
    nodes = () if grid.ep_nodes is None else (grid.ep_nodes.across, grid.ep_nodes.within)
    for expert in (grid.ep_group, grid.edp_group, *nodes):  # their own communicators where no other group has them
        if expert is not None and all(expert is not g for g in kinds):
            kinds.insert(kinds.index(grid.pp_group), expert)
    return [None] + [g for g in kinds if g is not None]


def node_groups(grid) -> list:
    """The ep group's node sub-groups with communicators of their own (`ParallelGrid.ep_nodes`), across then
    within."""
    if grid.ep_nodes is None:
        return []
    return [g for g in (grid.ep_nodes.across, grid.ep_nodes.within) if g is not grid.ep_group]


def create_communicators(grid, device) -> float:
    """One element through every group of `grid` and every directed channel of its pipeline, on `device`;
    returns the seconds it took. `ParallelGrid` calls it on every rank once it has created its groups (so this
    module takes the grid without importing it)."""
    start = time.perf_counter()
    if device == "auto":
        nccl = dist.get_backend() == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    one = torch.zeros(1, device=device)
    for group in collective_groups(grid):
        dist.all_reduce(one, group=group)
    if grid.ep > 1:
        dist.all_to_all_single(torch.zeros(grid.ep, device=device), torch.zeros(grid.ep, device=device),
                               group=grid.ep_group)
    for group in node_groups(grid):  # the node dispatcher's pairs, across the nodes and within each
        n = dist.get_world_size(group)
        dist.all_to_all_single(torch.zeros(n, device=device), torch.zeros(n, device=device), group=group)
    for round_ in channel_rounds(grid.pp):
        for src, dst in round_:
            if grid.pp_rank == src:
                dist.isend(one, dst=grid.stage_rank(dst), group=grid.p2p_group(src, dst)).wait()
            elif grid.pp_rank == dst:
                dist.irecv(one, src=grid.stage_rank(src), group=grid.p2p_group(src, dst)).wait()
    # The context-parallel ring's pairs (mlplat.parallel.context): neighbours on the cp group, in the same rounds.
    for round_ in channel_rounds(grid.cp):
        for src, dst in round_:
            if grid.cp_rank == src:
                dist.isend(one, dst=grid.cp_ranks[dst], group=grid.cp_group).wait()
            elif grid.cp_rank == dst:
                dist.irecv(one, src=grid.cp_ranks[src], group=grid.cp_group).wait()
    return time.perf_counter() - start
