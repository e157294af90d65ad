"""A toy token dispatcher written outside mlplat, registered by the tests that run it (tests/parallel/test_moe.py:
through the engine, equal to one process; tests/perf/test_transport.py: through the transport model), proving that
a dispatcher is its runtime class plus one registry entry (`mlplat.specs.dispatchers`)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from mlplat.parallel.dispatch import Dispatched, permute
from mlplat.parallel.mappings import gather_rows, reduce_scatter_rows
from mlplat.specs.dispatchers import Collective, Dispatcher


class ToyDispatcher:
    """Every rank gathers the ep group's tokens, their experts and gates, and picks its own experts' assignments one
    expert at a time; the outputs, summed per token, are reduce-scattered back."""

    def __init__(self, num_experts, capacity_factor, ep, ep_rank, group):
        self.num_experts, self.capacity_factor, self.group = num_experts, capacity_factor, group
        self.local = num_experts // ep
        self.first = ep_rank * self.local

    def dispatch(self, tokens, chosen, gates):
        p = permute(chosen, gates, self.num_experts, self.capacity_factor)
        expert = torch.full((chosen.numel(),), -1, dtype=chosen.dtype, device=chosen.device)
        expert[p.assignment] = chosen.reshape(-1)[p.assignment]  # -1: dropped by the capacity
        every = gather_rows(tokens, self.group)
        parts = [torch.empty_like(expert) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(parts, expert, group=self.group)
        expert = torch.cat(parts)
        weight = gather_rows(gates, self.group).reshape(-1)
        picked = [(expert == self.first + e).nonzero().squeeze(1) for e in range(self.local)]
        assignment = torch.cat(picked)
        token = assignment // chosen.shape[1]
        counts = torch.tensor([len(x) for x in picked], device=tokens.device)
        return Dispatched(every[token], weight[assignment], counts, (token, every.shape), p.assigned, p.kept)

    def combine(self, out, handle):
        token, shape = handle
        return reduce_scatter_rows(out.new_zeros(shape).index_add(0, token, out), self.group)


def _tokens(t):
    return t.ep * t.routed * t.hidden * t.elem


TOY = Dispatcher(
    "toy_gather", "a test's toy: gather everything, loop over the experts", ToyDispatcher,
    forward=(Collective("tokens", "all_gather", _tokens), Collective("experts", "all_gather",
                                                                     lambda t: 8 * t.ep * t.assignments, "routing"),
             Collective("gates", "all_gather", lambda t: t.ep * t.assignments * t.gate, "routing"),
             Collective("outputs", "reduce_scatter", _tokens)),
    backward=(Collective("outputs", "all_gather", _tokens),
              Collective("gates", "reduce_scatter", lambda t: t.ep * t.assignments * t.gate, "routing"),
              Collective("tokens", "reduce_scatter", _tokens)),
    buffer_rows=lambda t: 2 * t.ep * t.routed)
