"""Expert parallelism's token dispatchers, one entry each: everything mlplat knows about a dispatcher, in one place.

Pure data, no torch (as the pipeline schedules' registry, `mlplat.parallel.layout.registry`). An entry names a
dispatcher (the value of `model.moe.dispatcher`), the collectives one MoE layer posts on its ep group per
micro-batch, in order, with what each carries per rank (`Traffic`), the token buffers it holds while the layer runs,
and where its runtime lives (`impl`: a class, or "module:Class" imported when a layer is built; the runtime's
contract is `mlplat.parallel.dispatch.TokenDispatcher`). From the entry the config accepts the name, the MoE layer
builds the dispatcher, the cost model charges its collectives (`mlplat.perf.cluster`), the memory model its
buffers (`mlplat.perf.memory`) and the transport model runs its collectives beside the pipeline's transfers
(`mlplat.parallel.layout.exchange`); nothing else branches on a dispatcher's name.

Adding a dispatcher is its runtime class plus one `register(Dispatcher(...))`; `registered` adds one for the length
of a `with` block (a test's toy dispatcher, tests/parallel/test_moe.py and tests/perf/test_transport.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from mlplat.specs.registry import Part, Registry

FP8_ROW_SCALE_BYTES = 4  # model.moe.fp8_dispatch: each row's fp32 scale travels with its e4m3 codes


@dataclass(frozen=True)
class Traffic:
    """One rank's side of one MoE layer and micro-batch: the tokens it routes, each to top_k experts, hidden wide in
    `elem` bytes, the gates in `gate` bytes each (the router's dtype), over an ep group of `ep` ranks; `fp8`: the
    tokens dispatched in FP8 (model.moe.fp8_dispatch), a byte per element and a 4-byte scale per row."""

    routed: float
    top_k: int
    hidden: int
    elem: int
    gate: int
    ep: int
    fp8: bool = False
    # How the routing spreads over the ep group's nodes of `per_node` ranks (0: one node), what the node dispatcher's
    # bytes follow: E `experts` in `n_groups` groups, a token's k among the experts of its `topk_groups` best
    experts: int = 0
    n_groups: int = 1
    topk_groups: int = 1
    per_node: int = 0

    @property
    def assignments(self) -> float:
        return self.routed * self.top_k

    @property
    def nodes(self) -> int:
        return self.ep // self.per_node if self.per_node else 1

    @property
    def node_limited(self) -> bool:
        """Group-limited routing whose groups each lie on one node (a node holds whole groups): a token's experts
        then lie on at most topk_groups nodes (DeepSeek-V3's node-limited routing)."""
        return self.experts > 0 and self.n_groups > 1 and \
            self.experts // self.nodes % (self.experts // self.n_groups) == 0

    @property
    def nodes_per_token(self) -> float:
        """The expected number of distinct nodes holding a token's k experts under uniform routing: among its
        topk_groups groups (each assumed to take one of the k) under node-limited routing, else among k experts."""
        if not self.experts:
            return min(self.top_k, self.nodes)
        spread = _distinct(self.nodes, self.experts // self.nodes, self.top_k)
        if self.node_limited:
            return min(spread, _distinct(self.nodes, self.n_groups // self.nodes, self.topk_groups))
        return spread

    @property
    def ranks_per_token(self) -> float:
        """The expected number of distinct ep ranks holding a token's k experts under uniform routing (among the
        experts of its topk_groups groups where each group is whole ranks' experts)."""
        if not self.experts:
            return min(self.top_k, self.ep)
        local, group = self.experts // self.ep, self.experts // self.n_groups
        if self.n_groups > 1 and group % local == 0:
            return _distinct(self.topk_groups * group // local, local, self.top_k)
        return _distinct(self.ep, local, self.top_k)

    @property
    def dispatched_row(self) -> float:
        """Bytes of one token row as the dispatch sends it (the way back, outputs and gradients: hidden·elem)."""
        return self.hidden + FP8_ROW_SCALE_BYTES if self.fp8 else self.hidden * self.elem


def _distinct(units: int, per_unit: int, picks: int) -> float:
    """Expected distinct units hit by `picks` draws without replacement from units·per_unit items, per_unit each."""
    total = units * per_unit
    return units * (1 - math.comb(total - per_unit, picks) / math.comb(total, picks))


@dataclass(frozen=True)
class Collective:
    """One collective on the ep group: `what` it carries (the label runs and the transport model compare), its
    torch.distributed `kind`, its payload per rank in bytes, and its `part` of the layer's communication as the
    cost model reports it: "tokens" (the activations and their gradients), "routing" (gates, expert indices) or
    "sizes" (the split sizes the host waits for)."""

    what: str
    kind: str  # "all_to_all" | "all_gather" | "reduce_scatter"
    payload: Callable[[Traffic], float]
    part: str = "tokens"
    # the ranks it runs over: the ep group, or one of its node sub-groups (the node dispatcher's): "across" the
    # nodes (the ranks of equal in-node index), "within" a node
    over: str = "ep"

    @property
    def skewed(self) -> bool:
        """Its bytes follow the routing, so the busiest rank carries model.moe.plan_imbalance times the mean."""
        return self.part != "sizes"


@dataclass(frozen=True)
class Dispatcher(Part):
    forward: tuple[Collective, ...]
    backward: tuple[Collective, ...]  # autograd's order: the later-created of two ready nodes first
    # Token rows (hidden wide) its own buffers hold beside the permuted assignments while the layer runs
    buffer_rows: Callable[[Traffic], float]
    # The host reads device values once per forward (the split sizes, the rows its experts take): a stream sync on
    # a GPU (`mlplat.parallel.dispatch.host_read`)
    host_read: bool = False
    # Its runtime sends the tokens in FP8 under model.moe.fp8_dispatch (`TokenDispatcher.fp8`)
    fp8_rows: bool = False
    # Its runtime posts each collective asynchronously and hands over to a paired pass before waiting for it, so the
    # overlapped schedule (1f1b_overlap) hides its collectives behind the other micro-batch's compute
    hands_over: bool = False
    # Its runtime takes the ep group's node sub-groups too (`mlplat.parallel.grid.EpNodes`; parallel.ep_per_node)
    node_groups: bool = False

    def collectives(self, phase: str) -> tuple[tuple[str, str], ...]:
        """(what, kind) of each collective of `phase` ("forward" | "backward"), in order."""
        return tuple((c.what, c.kind) for c in getattr(self, phase))


_ENTRIES: Registry[Dispatcher] = Registry("token dispatcher", "model.moe.dispatcher")
register, unregister, registered = _ENTRIES.register, _ENTRIES.unregister, _ENTRIES.registered
names, get = _ENTRIES.names, _ENTRIES.get


def _tokens(t: Traffic) -> float:
    return t.assignments * t.hidden * t.elem


def _dispatched_tokens(t: Traffic) -> float:
    return t.assignments * t.dispatched_row


def _gates(t: Traffic) -> float:
    return t.assignments * t.gate


def _gathered_tokens(t: Traffic) -> float:
    return t.ep * t.routed * t.hidden * t.elem


def _gathered_dispatched_tokens(t: Traffic) -> float:
    return t.ep * t.routed * t.dispatched_row


def _gathered_experts(t: Traffic) -> float:
    return t.ep * t.assignments * 8  # int64 indices


def _gathered_gates(t: Traffic) -> float:
    return t.ep * t.assignments * t.gate


# The assignments, sorted by expert, go to their experts' ranks in one all-to-all with uneven splits, their gates in
# a second, the outputs come back in a third; first, the counts per local expert (4 bytes per rank of the group)
# and the host's read of the split sizes.
register(Dispatcher(
    "alltoall", "all-to-all of each assignment to its expert's rank and back",
    "mlplat.parallel.dispatch:AllToAllDispatcher",
    forward=(Collective("counts", "all_to_all", lambda t: 4 * t.ep, "sizes"),
             Collective("tokens", "all_to_all", _dispatched_tokens),
             Collective("gates", "all_to_all", _gates, "routing"),
             Collective("outputs", "all_to_all", _tokens)),
    backward=(Collective("outputs", "all_to_all", _tokens),
              Collective("gates", "all_to_all", _gates, "routing"),
              Collective("tokens", "all_to_all", _tokens)),
    buffer_rows=lambda t: 2 * t.assignments,  # the rank's assignments sent out and their outputs back
    host_read=True, fp8_rows=True, hands_over=True))

# Every rank all-gathers the ep group's tokens and their routing, runs its experts on the assignments that chose
# them, and a reduce-scatter returns each rank the sum for its tokens: equal-sized collectives; the host reads how
# many rows its experts take.
register(Dispatcher(
    "allgather", "all-gather of the ep group's tokens, reduce-scatter of the outputs",
    "mlplat.parallel.dispatch:AllGatherDispatcher",
    forward=(Collective("tokens", "all_gather", _gathered_dispatched_tokens),
             Collective("experts", "all_gather", _gathered_experts, "routing"),
             Collective("gates", "all_gather", _gathered_gates, "routing"),
             Collective("outputs", "reduce_scatter", _gathered_tokens)),
    backward=(Collective("outputs", "all_gather", _gathered_tokens),
              Collective("gates", "reduce_scatter", _gathered_gates, "routing"),
              Collective("tokens", "reduce_scatter", _gathered_tokens)),
    buffer_rows=lambda t: 2 * t.ep * t.routed,  # the gathered tokens and the reduce-scatter's input
    host_read=True, fp8_rows=True))


def _node_rows(t: Traffic) -> float:
    return t.routed * t.nodes_per_token


def _rank_rows(t: Traffic) -> float:
    return t.routed * t.ranks_per_token


# DeepSeek-V3's dispatch (arXiv 2412.19437, §3.2.2) over the ep group split into nodes of parallel.ep_per_node
# ranks: each token row crosses to each node holding one of its experts once, to the rank of its own in-node index,
# with its assignments there (gates, expert ids); that rank forwards it inside the node to each rank holding one of
# them. The combine runs back: each rank sums its experts' weighted outputs per row, each forwarder the rows of a
# token, and one row per (token, node) crosses back. First, every rank's rows per destination gathered over the ep
# group, which sizes every hop (the layer's one host read).
register(Dispatcher(
    "node_alltoall", "all-to-all of each token once per node, forwarded inside it to its experts' ranks",
    "mlplat.parallel.node_dispatch:NodeAllToAllDispatcher",
    forward=(Collective("counts", "all_gather", lambda t: t.ep * (2 * t.ep + t.nodes) * 8, "sizes"),
             Collective("tokens", "all_to_all", lambda t: _node_rows(t) * t.hidden * t.elem, over="across"),
             Collective("gates", "all_to_all", lambda t: _node_rows(t) * t.top_k * t.gate, "routing", "across"),
             Collective("experts", "all_to_all", lambda t: _node_rows(t) * t.top_k * 8, "routing", "across"),
             Collective("tokens", "all_to_all", lambda t: _rank_rows(t) * t.hidden * t.elem, over="within"),
             Collective("gates", "all_to_all", lambda t: _rank_rows(t) * t.top_k * t.gate, "routing", "within"),
             Collective("experts", "all_to_all", lambda t: _rank_rows(t) * t.top_k * 8, "routing", "within"),
             Collective("outputs", "all_to_all", lambda t: _rank_rows(t) * t.hidden * t.elem, over="within"),
             Collective("outputs", "all_to_all", lambda t: _node_rows(t) * t.hidden * t.elem, over="across")),
    backward=(Collective("outputs", "all_to_all", lambda t: _node_rows(t) * t.hidden * t.elem, over="across"),
              Collective("outputs", "all_to_all", lambda t: _rank_rows(t) * t.hidden * t.elem, over="within"),
              Collective("gates", "all_to_all", lambda t: _rank_rows(t) * t.top_k * t.gate, "routing", "within"),
              Collective("tokens", "all_to_all", lambda t: _rank_rows(t) * t.hidden * t.elem, over="within"),
              Collective("gates", "all_to_all", lambda t: _node_rows(t) * t.top_k * t.gate, "routing", "across"),
              Collective("tokens", "all_to_all", lambda t: _node_rows(t) * t.hidden * t.elem, over="across")),
    # the rows sent across and their outputs back, and the same of the rows forwarded inside the node
    buffer_rows=lambda t: 2 * (_node_rows(t) + _rank_rows(t)),
    host_read=True, hands_over=True, node_groups=True))
