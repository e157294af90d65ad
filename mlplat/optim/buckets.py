"""The gradient buckets' size and how the distributed optimizer deals whole parameters to its shards, torch-free so
that the cost models read the engine's own figure and rule."""
from __future__ import annotations

from typing import Sequence

BUCKET_BYTES = 4 * 2**20  # reduced as each fills in backward; small enough to start early, large enough per launch


def deal(costs: Sequence[float], bins: int, load: list[float] | None = None) -> list[int]:
    """Each item's bin when items of `costs` are dealt whole to `bins` ranks: the costliest first, each to the bin with
    the least cost so far (ties: the first such bin, so every rank deals alike). Graham's longest-processing-time
    rule: the busiest bin carries at most the mean plus (1 - 1/bins) of the costliest item, and at most 4/3 of the
    best dealing's busiest. `load`: the bins' cost so far (earlier buckets'), added to in place."""
    owner = [0] * len(costs)
    load = [0.0] * max(1, bins) if load is None else load
    for i in sorted(range(len(costs)), key=lambda i: -costs[i]):
        owner[i] = min(range(len(load)), key=lambda b: load[b])
        load[owner[i]] += costs[i]
    return owner
