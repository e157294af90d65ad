"""The node dispatcher (`node_alltoall`, `mlplat.specs.dispatchers`): DeepSeek-V3's dispatch (arXiv 2412.19437,
§3.2.2), each token sent across nodes once per node that holds one of its experts, then forwarded inside the node.

The ep group is split into nodes of n consecutive ep ranks (`mlplat.parallel.grid.EpNodes`); ep rank a·n + i is
the i-th rank of node a. On each rank, per MoE layer and micro-batch:

1. the rank's kept assignments (`sort_assignments`: capacity on its own tokens, as alltoall) give each token the
   nodes and the ranks that hold one of its experts; every rank's rows per destination rank, rows per destination
   node and assignments per destination rank are all-gathered over the ep group, and the host reads every hop's
   split sizes from them at once (the layer's one host read);
2. across: each (token, node) pair is one row, sent to the rank of the sender's in-node index on that node, with
   the token's k expert ids and gates there (-1 and 0 where an expert lies elsewhere or was dropped);
3. within: the forwarder sends each row it received to every rank of its node holding one of the row's experts,
   with the ids and gates of that rank's experts alone;
4. the destination expands each row into its assignments, sorted by local expert for the grouped GEMM.

The combine runs the hops back, summing as it goes: the destination sums its experts' weighted outputs per row
(token and source), the forwarder sums the rows of one received row (token and node), the source sums one row per
node into the token. The sums run in another order than alltoall's (one per token): equal to it to the last few
ulps, not bit for bit (tests/parallel/test_moe.py). Backward runs every hop's all-to-all in reverse through
autograd (`_Collective`), each posted and completed through `_Waits.done`: the overlapped schedule hands over at
each (1f1b_overlap).

The bytes: a token crosses nodes once per node of its experts (at most model.moe.topk_groups under node-limited
routing, where each group's experts lie on one node), where alltoall sends it once per expert.
"""
from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from torch import Tensor

from mlplat.parallel import dispatch as base  # its host_read looked up at each call (the tests count them)
from mlplat.parallel.dispatch import (
    Dispatched,
    LocalDispatcher,
    _all_to_all,
    _Collective,
    add_rows,
    count,
    sort_assignments,
)


def _pick(mask: Tensor, n: int) -> Tensor:
    """The indices of mask's n True values in order, on the device (n read already: no nonzero's host sync)."""
    return torch.argsort((~mask).to(torch.int8), stable=True)[:n]


class NodeAllToAllDispatcher(LocalDispatcher):
    """`node_alltoall` (the module docstring)."""

    def __init__(self, num_experts: int, capacity_factor: float | None, ep: int, ep_rank: int, group, nodes):
        super().__init__(num_experts, capacity_factor)
        self.ep, self.group, self.n = ep, group, nodes.size
        self.across, self.within = nodes.across, nodes.within
        self.nodes = ep // self.n
        self.node, self.index = divmod(ep_rank, self.n)
        self.rank, self.local = ep_rank, num_experts // ep

    def dispatch(self, tokens: Tensor, chosen: Tensor, gates: Tensor) -> Dispatched:
        s = sort_assignments(chosen, gates, self.num_experts, self.capacity_factor)
        n_tok, k = chosen.shape
        ep, n, nodes, a, i = self.ep, self.n, self.nodes, self.node, self.index
        kept = torch.ones_like(chosen, dtype=torch.bool) if s.dropped is None else ~s.dropped.view(n_tok, k)
        rank_of = chosen // self.local  # each assignment's ep rank
        # per token: its kept assignments on each rank, whether a node holds any
        on_rank = torch.zeros(n_tok, ep, dtype=torch.int64, device=chosen.device).scatter_add_(
            1, rank_of, kept.to(torch.int64)) > 0
        on_node = on_rank.view(n_tok, nodes, n).any(2)
        mine = torch.cat([on_rank.sum(0), on_node.sum(0), s.kept.view(ep, -1).sum(1)])  # rows, rows, assignments
        table = mine.new_empty(ep, mine.numel())
        self.done("the expert dispatch's counts all-gather",
                  dist.all_gather(list(table.unbind(0)), mine, group=self.group, async_op=True))
        rows = table[:, :ep].view(nodes, n, nodes, n)  # [source node, index, destination node, index]
        node_rows = table[:, ep:ep + nodes].view(nodes, n, nodes)
        sizes = base.host_read(torch.cat([node_rows[a, i], node_rows[:, i, a], rows[:, i, a].sum(0),
                                     rows[:, :, a, i].sum(0), table[:, ep + nodes + self.rank].sum().view(1)]))
        cross_send, cross_recv = sizes[:nodes], sizes[nodes:2 * nodes]
        in_send, in_recv, assignments = sizes[2 * nodes:2 * nodes + n], sizes[2 * nodes + n:-1], sizes[-1]

        # across: one row per (token, destination node), by node then token
        pair = _pick(on_node.t().reshape(-1), sum(cross_send))
        token, dest = pair % n_tok, pair // n_tok
        there = kept[token] & (rank_of[token] // n == dest.unsqueeze(1))
        cross = partial(self._exchange, group=self.across, send=cross_send, recv=cross_recv)
        rows_a = cross(tokens[token], label="the expert dispatch's all-to-all across nodes")
        gates_a = cross(torch.where(there, gates[token], 0.0), label="the expert dispatch's gates across nodes")
        ids_a = cross(torch.where(there, chosen[token], -1), label="the expert dispatch's experts across nodes")

        # within: each received row to each rank of this node holding one of its experts, by rank then row
        in_node = torch.where(ids_a >= 0, ids_a // self.local - a * n, n)  # n: no expert here
        held = torch.zeros(ids_a.shape[0], n + 1, dtype=torch.int64, device=ids_a.device).scatter_add_(
            1, in_node, torch.ones_like(in_node))[:, :n] > 0
        fwd = _pick(held.t().reshape(-1), sum(in_send))
        row, to = fwd % ids_a.shape[0], fwd // ids_a.shape[0]
        here = in_node[row] == to.unsqueeze(1)
        near = partial(self._exchange, group=self.within, send=in_send, recv=in_recv)
        rows_w = near(rows_a[row], label="the expert dispatch's all-to-all within the node")
        gates_w = near(torch.where(here, gates_a[row], 0.0), label="the expert dispatch's gates within the node")
        ids_w = near(torch.where(here, ids_a[row], -1), label="the expert dispatch's experts within the node")

        # this rank's assignments, by local expert (arrival order within one)
        expert = torch.where(ids_w >= 0, ids_w - self.rank * self.local, self.local).reshape(-1)
        assignment = torch.argsort(expert, stable=True)[:assignments]
        received = count(expert, self.local + 1)[:self.local]
        handle = (assignment // k, rows_w.shape[0], row, rows_a.shape[0], token, n_tok, in_send, in_recv,
                  cross_send, cross_recv)
        return Dispatched(rows_w[assignment // k], gates_w.reshape(-1)[assignment], received, handle, s.assigned,
                          s.kept)

    def combine(self, out: Tensor, handle) -> Tensor:
        arrived, m, row, r, token, n_tok, in_send, in_recv, cross_send, cross_recv = handle
        h = out.shape[1]
        per_row = add_rows(out.new_zeros(m, h), arrived, out)  # per (token, source) on this rank
        back = self._exchange(per_row, self.within, in_recv, in_send, "the expert combine's all-to-all within the node")
        per_node = add_rows(out.new_zeros(r, h), row, back)  # per (token, node) on the forwarder
        home = self._exchange(per_node, self.across, cross_recv, cross_send,
                              "the expert combine's all-to-all across nodes")
        return add_rows(out.new_zeros(n_tok, h), token, home)

    def _exchange(self, x: Tensor, group, send: list[int], recv: list[int], label: str) -> Tensor:
        """x's rows in `send` sized pieces to the group's ranks, `recv` sized ones received, posted and completed
        by `done`; the gradient the way back (floating x only)."""
        done = partial(self.done, label)
        if not x.is_floating_point():
            out, work = _all_to_all(x, send, recv, group)
            done(work)
            return out
        return _Collective.apply(x, partial(_all_to_all, send=send, recv=recv, group=group),
                                 partial(_all_to_all, send=recv, recv=send, group=group), done)
