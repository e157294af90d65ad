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

    @property
    def assignments(self) -> float:
        return self.routed * self.top_k

    @property
    def dispatched_row(self) -> float:
        """Bytes of one token row as the dispatch sends it (the way back, outputs and gradients: hidden·elem)."""
        return self.hidden + FP8_ROW_SCALE_BYTES if self.fp8 else self.hidden * self.elem


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
