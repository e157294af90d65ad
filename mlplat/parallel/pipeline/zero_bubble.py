"""Zero-bubble compute orders (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024), as pure data.

The backward of a chunk is split in two: B, the gradient w.r.t. the chunk's input (on the critical path: the
previous stage waits for it), and W, the gradients w.r.t. its weights (needed only by the optimizer). W can
therefore fill the idle time that 1F1B spends waiting for gradients.

Both orders below come from one list scheduler, run once per (schedule, p, m) under unit costs
(F = B = W = 1, free transfers): whenever a rank is free it runs, in this priority, its oldest W if p
micro-batches' worth of W's are pending, a B whose gradient has arrived, a F whose input has arrived if its
activation budget allows, else its oldest pending W. The result is a fixed instruction order, executed,
simulated and drawn like every other schedule.

Memory. Activations count from F to B (B consumes them; as in the paper, what W still needs - the inputs of
the weight GEMMs and their output gradients - is counted apart): the budget below caps them at 1F1B's peak,
and pending W's are capped at p micro-batches per rank.

  zb_h1  v = 1, chunk r on rank r. Budget: p - r micro-batches, 1F1B's own peak on rank r. Warm-up: the
         p - r - 1 forwards of 1F1B; W's fill the cool-down where 1F1B idles. At F = B = W the simulated bubble
         is (p-1)/(3m), a third of 1F1B's (p-1)/m (tests/parallel/pipeline/test_schedules.py).
  zbv    v = 2, V-shaped placement: rank r holds chunks r and 2p-1-r, so the forward runs down the ranks and
         back up, and rank 0 computes both the first chunk and the loss. Budget: 2p chunk activations (p
         micro-batches: 1F1B's peak, on rank 0) on every rank. Warm-up: as many forwards as the budget and the
         arriving inputs allow; among ready forwards the second (upward) chunk goes first, so micro-batches
         reach the loss and their backward starts early. Simulated bubble at F = B = W: about a sixth of
         1F1B's.
"""
from __future__ import annotations

import heapq
from functools import lru_cache

from mlplat.parallel.pipeline.layout import ZERO_BUBBLE, PipelineLayout

F, B, W = "F", "B", "W"


@lru_cache(maxsize=256)
def zero_bubble_orders(kind: str, p: int, m: int) -> tuple[tuple[tuple[str, int, int], ...], ...]:
    """Per rank, the compute order as (op, global chunk, micro-batch) with op in F, B, W."""
    if kind not in ZERO_BUBBLE:
        raise ValueError(f"{kind} is not a zero-bubble schedule")
    layout = PipelineLayout(p, 2 if kind == "zbv" else 1, kind)
    n_chunks = layout.num_chunks
    # F's ahead of B's per rank, in chunk activations: 1F1B's p - r micro-batches (zb_h1); p micro-batches of
    # two chunks each on every rank (zbv).
    budget = [p - r for r in range(p)] if kind == "zb_h1" else [2 * p] * p
    w_limit = n_chunks  # pending W's per rank: at most p micro-batches' worth (1 chunk = 1/v micro-batch)
    last = layout.last_chunk
    done: dict[tuple[str, int, int], int] = {}  # op -> end time
    pending_w: list[list[tuple[int, int]]] = [[] for _ in range(p)]  # per rank, (mb, chunk) whose W is due
    alive = [0] * p  # chunk activations alive per rank (F done, B not yet)
    orders: list[list[tuple[str, int, int]]] = [[] for _ in range(p)]
    chunks = [layout.chunks_of(r) for r in range(p)]
    next_f = {c: 0 for c in range(n_chunks)}  # next micro-batch to forward through chunk c
    next_b = {c: 0 for c in range(n_chunks)}
    total = 3 * n_chunks * m
    t = 0
    while len(done) < total:
        for r in range(p):
            pick = None
            if len(pending_w[r]) >= w_limit:  # the weight-gradient residue stays bounded
                mb, c = heapq.heappop(pending_w[r])
                pick = (W, c, mb)
            # 1. a backward whose gradient is there (later chunks first: they are nearer the loss)
            for c in ([] if pick else sorted(chunks[r], reverse=True)):
                mb = next_b[c]
                if mb < m and done.get((F, c, mb), t + 1) <= t and (c == last or done.get((B, c + 1, mb), t + 1) <= t):
                    pick = (B, c, mb)
                    break
            # 2. a forward whose input is there, within the activation budget (later chunks first)
            if pick is None and alive[r] < budget[r]:
                for c in sorted(chunks[r], reverse=True):
                    mb = next_f[c]
                    if mb < m and (c == 0 or done.get((F, c - 1, mb), t + 1) <= t):
                        pick = (F, c, mb)
                        break
            # 3. the oldest pending weight gradient
            if pick is None and pending_w[r]:
                mb, c = heapq.heappop(pending_w[r])
                pick = (W, c, mb)
            if pick is None:
                continue
            op, c, mb = pick
            if op == F:
                next_f[c] += 1
                alive[r] += 1
            elif op == B:
                next_b[c] += 1
                alive[r] -= 1
                heapq.heappush(pending_w[r], (mb, c))
            orders[r].append(pick)
            done[pick] = t + 1
        t += 1
        if t > 10 * total + 10:  # cannot happen for a budget >= 1F1B's; a guard against a broken edit
            raise RuntimeError(f"{kind} p={p} m={m}: the list scheduler made no progress")
    return tuple(tuple(o) for o in orders)
