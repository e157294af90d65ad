"""Zero-bubble compute orders (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, and "Pipeline Parallelism
with Controllable Memory", 2024), as pure data.

The backward of a chunk is split in two: B, the gradient w.r.t. the chunk's input (on the critical path: the
previous stage waits for it), and W, the gradients w.r.t. its weights (needed only by the optimizer). W can
therefore fill the idle time that 1F1B spends waiting for gradients.

Every order below comes from one list scheduler, run per (schedule, p, m) under unit costs
(F = B = W = 1, free transfers): whenever a rank is free it runs, in this priority, its oldest W if its pending
W's are at their limit, a B whose gradient has arrived, a F whose input has arrived if its activation limit
allows, else its oldest pending W. The result is a fixed instruction order, executed, simulated and drawn like
every other schedule.

Memory. Activations count from F to B (B consumes them; as in the papers, what W still needs - the inputs of
the weight GEMMs and their output gradients - is counted apart, as pending W's).

  zb_h1   v = 1, chunk r on rank r. Limit: p - r micro-batches, 1F1B's own peak on rank r; pending W's: p
          micro-batches. Warm-up: the p - r - 1 forwards of 1F1B; W's fill the cool-down where 1F1B idles. At
          F = B = W the simulated bubble is (p-1)/(3m), a third of 1F1B's (p-1)/m.
  zb_h2   zb_h1's placement at about twice 1F1B's memory: 2(p - r) - 1 micro-batches on rank r (2p - 1 on rank 0),
          pending W's: 2p - 1 micro-batches. The extra forwards keep every rank busy from its
          first F to its last W: one step alone has zb_h1's bubble, since rank r still waits r forwards for its
          first input, but back to back (nothing global between steps: `mlplat.perf.simulator.back_to_back`) at
          F = B = W the steps have none (checked for every p <= 8 and m from 2p - 1 to 4p), as the paper's ZB-H2.
  zbv     v = 2, V-shaped placement: rank r holds chunks r and 2p-1-r, so the forward runs down the ranks and
          back up, and rank 0 computes both the first chunk and the loss. Limit: 2p chunk activations (p
          micro-batches: 1F1B's peak, on rank 0) on every rank; pending W's: p micro-batches. Warm-up: as many
          forwards as the limit and the arriving inputs allow; among ready forwards the second (upward) chunk
          goes first, so micro-batches reach the loss and their backward starts early. Micro-batches then go
          through the V in rounds of p. Where a last, partial round leaves ranks idle inside the step, waiting
          on its round trip (at p = 4, m = 9: 6 chunk computes in all), its forwards no longer wait behind
          ready backwards: they alternate with them, so its micro-batches set out early without a burst of
          sends that the receiver is not yet ready for (NCCL's send window). At F = B = W, for every m >= 2p
          (p <= 8), one step's simulated bubble is (p-1)/(6m): rank r waits r chunk forwards for its first
          input and never again, the least any one step can have, and the stagger that the previous step's
          tail fills when steps run back to back.
  v_half  the V of zbv at half of 1F1B's memory (Qi et al.'s V-Half): p chunk activations (p/2 micro-batches)
          on every rank, and pending W's of p/2 micro-batches. The p are split between the rank's two chunks
          in proportion to how long an activation of each lives - from its F, through the forwards of the
          chunks after it and their backwards, to its B: 2(2p-1-c)+1 computes for chunk c - rounded down, to
          nearest or up (each chunk at least 1), whichever of the three gives the shortest step. At F = B = W
          and 4 <= p <= 8, m >= 2p its simulated bubble is 0.42-0.64 of 1F1B's; at p <= 3 it is larger.
"""
from __future__ import annotations

import heapq
import math
from functools import lru_cache, wraps
from typing import Callable

F, B, W = "F", "B", "W"
Orders = tuple[tuple[tuple[str, int, int], ...], ...]
# may_forward(rank, chunk, alive_on_rank, alive_in_chunk) -> whether one more activation of `chunk` fits
Limit = Callable[[int, int, int, dict], bool]


def _per_rank(orders: Callable[..., Orders]) -> Callable[..., tuple[tuple[str, int, int], ...]]:
    """The registry's order function (layout, m, rank) -> one rank's order, from a function of (layout, m) that
    orders every rank at once, as the list scheduler does: computed once per layout and m."""
    every_rank = lru_cache(maxsize=256)(orders)

    @wraps(orders)
    def order(layout, m: int, rank: int) -> tuple[tuple[str, int, int], ...]:
        return every_rank(layout, m)[rank]

    return order


@_per_rank
def zb_h1(layout, m: int) -> Orders:
    """1F1B's p - r micro-batches on rank r; pending W's: p micro-batches (one chunk per rank)."""
    p = layout.pp
    return _list_schedule(layout, m, lambda r, c, on_rank, in_chunk: on_rank < p - r, w_limit=p)[0]


@_per_rank
def zb_h2(layout, m: int) -> Orders:
    """2(p - r) - 1 micro-batches on rank r, about twice 1F1B's; pending W's: 2p - 1 micro-batches."""
    p = layout.pp
    return _list_schedule(layout, m, lambda r, c, on_rank, in_chunk: on_rank < 2 * (p - r) - 1,
                          w_limit=2 * p - 1)[0]


@_per_rank
def zbv(layout, m: int) -> Orders:
    """p micro-batches of two chunks each on every rank; pending W's: p micro-batches."""
    p = layout.pp
    orders, _, idle = _list_schedule(layout, m, lambda r, c, on_rank, in_chunk: on_rank < 2 * p, w_limit=2 * p)
    if idle:  # the last, partial round of p micro-batches alternates its forwards with ready backwards
        orders = _list_schedule(layout, m, lambda r, c, on_rank, in_chunk: on_rank < 2 * p, w_limit=2 * p,
                                eager=m - m % p)[0]
    return orders


@_per_rank
def v_half(layout, m: int) -> Orders:
    """The shortest step of the three roundings of the per-chunk limits (the first of them on a tie)."""
    tries = [_v_half(layout, m, rounding) for rounding in (math.floor, _nearest, math.ceil)]
    return min(tries, key=lambda orders_and_makespan: orders_and_makespan[1])[0]


def _v_half(layout, m: int, rounding: Callable[[float], int]) -> tuple[Orders, int]:
    """v_half's order under the per-chunk limits of one rounding; pending W's up to the rank's budget."""
    caps = v_half_limits(layout.pp, rounding)
    return _list_schedule(layout, m, lambda r, c, on_rank, in_chunk: in_chunk[c] < caps[c],
                          w_limit=v_half_budget(layout.pp))[:2]


def _nearest(x: float) -> int:
    return math.floor(x + 0.5)


def v_half_budget(p: int) -> int:
    """Chunk activations (and pending W's) a rank may hold under v_half: p, half of 1F1B's p micro-batches of two
    chunks; at least one per chunk."""
    return max(p, 2)


def v_half_limits(p: int, rounding: Callable[[float], int]) -> dict[int, int]:
    """Chunk -> the activations it may hold under v_half: rank r's budget split between its chunks r and 2p-1-r
    in proportion to their activations' lifetimes, 4p-2r-1 and 2r+1 computes (they sum to 4p)."""
    total = v_half_budget(p)
    caps = {}
    for r in range(p):
        down = min(total - 1, max(1, rounding(total * (4 * p - 2 * r - 1) / (4 * p))))
        caps[r], caps[2 * p - 1 - r] = down, total - down
    return caps


def _list_schedule(layout, m: int, may_forward: Limit, w_limit: int,
                   eager: int | None = None) -> tuple[Orders, int, int]:
    """The list scheduler above: per rank its compute order, the step's length in unit computes, and the unit
    computes ranks sat idle between their first and last compute. A forward of a micro-batch >= eager (none by
    default) goes ahead of a ready backward unless the rank's previous compute was a forward."""
    p, n_chunks, last = layout.pp, layout.num_chunks, layout.last_chunk
    eager = m if eager is None else eager
    done: dict[tuple[str, int, int], int] = {}  # op -> end time
    pending_w: list[list[tuple[int, int]]] = [[] for _ in range(p)]  # per rank, (mb, chunk) whose W is due
    on_rank = [0] * p  # chunk activations alive per rank (F done, B not yet)
    in_chunk = {c: 0 for c in range(n_chunks)}  # the same per chunk
    orders: list[list[tuple[str, int, int]]] = [[] for _ in range(p)]
    chunks = [sorted(layout.chunks_of(r), reverse=True) for r in range(p)]  # later chunks first: nearer the loss
    work = [3 * m * len(chunks[r]) for r in range(p)]
    next_f = {c: 0 for c in range(n_chunks)}  # next micro-batch to forward through chunk c
    next_b = {c: 0 for c in range(n_chunks)}
    total = 3 * n_chunks * m
    t = idle = 0
    while len(done) < total:
        for r in range(p):
            pick = None
            if len(pending_w[r]) >= w_limit:  # the weight-gradient residue stays bounded
                mb, c = heapq.heappop(pending_w[r])
                pick = (W, c, mb)
            backward = forward = None
            for c in ([] if pick else chunks[r]):  # a backward whose gradient is there
                mb = next_b[c]
                if mb < m and done.get((F, c, mb), t + 1) <= t and (c == last or done.get((B, c + 1, mb), t + 1) <= t):
                    backward = (B, c, mb)
                    break
            for c in ([] if pick else chunks[r]):  # a forward whose input is there, within the activation limit
                mb = next_f[c]
                if (mb < m and (c == 0 or done.get((F, c - 1, mb), t + 1) <= t)
                        and may_forward(r, c, on_rank[r], in_chunk)):
                    forward = (F, c, mb)
                    break
            if pick is None:
                eager_now = forward and forward[2] >= eager and not (orders[r] and orders[r][-1][0] == F)
                pick = forward if forward and (backward is None or eager_now) else backward
            if pick is None and pending_w[r]:  # the oldest pending weight gradient
                mb, c = heapq.heappop(pending_w[r])
                pick = (W, c, mb)
            if pick is None:
                idle += 0 < len(orders[r]) < work[r]
                continue
            op, c, mb = pick
            if op == F:
                next_f[c] += 1
                on_rank[r] += 1
                in_chunk[c] += 1
            elif op == B:
                next_b[c] += 1
                on_rank[r] -= 1
                in_chunk[c] -= 1
                heapq.heappush(pending_w[r], (mb, c))
            orders[r].append(pick)
            done[pick] = t + 1
        t += 1
        if t > 10 * total + 10:  # cannot happen for the limits above; a guard against a broken edit
            raise RuntimeError(f"{layout.schedule} p={p} m={m}: the list scheduler made no progress")
    return tuple(tuple(o) for o in orders), t, idle
