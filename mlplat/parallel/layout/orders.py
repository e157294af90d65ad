"""The compute orders of GPipe, 1F1B (PipeDream-Flush) and interleaved 1F1B (Narayanan et al. 2021, Section 2.2),
as pure data: (layout, m, rank) -> the rank's (op, global chunk, micro-batch), op "F" or "B".

  gpipe        all m forwards, then all m backwards (v = 1). Peak in flight: m on every rank.
  1f1b         PipeDream-Flush: rank r runs w_r = min(p-r-1, m) warm-up forwards, then alternates one
               forward and one backward, then drains the remaining backwards (v = 1).
               Peak in flight: min(p-r, m) micro-batches on rank r.
  1f1b_overlap 1F1B whose steady state pairs each forward with the backward of an earlier micro-batch on the same
               rank, run as one combined compute (the pair's B is marked `paired`), each one's expert all-to-alls
               flying while the other computes (DeepSeek-V3's DualPipe pairing; Megatron-Core's combined 1F1B).
               A pair sends its outputs only when both are done, so rank r+1 must run a backward one pair ahead
               of rank r and a forward one pair behind: rank r runs w_r = min(2*(p-r-1) + 1, m) warm-up
               forwards (the last rank one, so its pair is F(k+1) with B(k)), then pairs, then the remaining
               backwards. With the pair costing F + B (nothing hidden) the step takes exactly 1F1B's time; the
               backwards keep 1F1B's order, so every gradient accumulates in the same micro-batch order.
               Peak in flight: min(2*(p-r), m) micro-batches on rank r (twice 1F1B's, as DualPipe's).
  interleaved  the paper's interleaved 1F1B (Megatron's order). Needs m % p == 0. The k-th forward on a
               rank runs local chunk index (k // p) % v on micro-batch (k // (p*v))*p + k % p, i.e. groups
               of p micro-batches go through one chunk before moving to the next chunk; backwards walk the
               local chunks in reverse with the same grouping. Rank r runs
                   w_r = min(2*(p-r-1) + (v-1)*p, m*v)
               warm-up forwards, then 1F1B steady state, then cool-down. v = 1 is exactly 1f1b.
               Unlike Megatron we keep this count also when m == p (Megatron then runs all forwards
               first): with blocking RECV / non-blocking SEND it does not deadlock and holds fewer
               activations on the later ranks.

Peak activations of interleaved (v > 1), in chunk activations (each 1/v of a micro-batch's activations
on that rank): the warm-up leaves w_r forwards in flight, each steady step adds one forward before it
retires one backward, so
        peak_r = min(2*(p-r-1) + (v-1)*p + 1, m*v)          (chunk activations)
i.e. peak_r / v micro-batches (v = 1 is 1f1b: min(p-r, m)). Rank 0 is the worst: min((v+1)*p - 1, m*v)
chunks, i.e. p + (p-1)/v micro-batches once m > p, versus p for 1f1b.

Bubble. With free transfers and the same per-chunk forward time f and backward time b on every rank
(any ratio b/f, b = 0 included), the simulated bubble fraction is exactly (p-1)/m for gpipe and 1f1b and
exactly (p-1)/(v*m) for interleaved, the paper's figures (checked exhaustively for p <= 8, v <= 4,
m <= 4p by tests/parallel/pipeline/test_schedules.py). Non-zero transfer times or uneven stages add to it.
"""
from __future__ import annotations

F, B = "F", "B"
PAIRED = True  # an order's 4th field on a B: it runs combined with the F just before it


def warmup_forwards(p: int, v: int, m: int, rank: int) -> int:
    """Number of forwards rank `rank` runs before its first backward under 1F1B (v = 1) or interleaved 1F1B."""
    if v == 1:
        # Rank r must keep forwarding until the first gradient can come back from the p-r-1 ranks after it.
        return min(p - rank - 1, m)
    # Interleaved: the first backward on rank r needs micro-batch 0 to go through all v*p chunks and come
    # back; Megatron's count (paper, Section 2.2.2) covers that with the (v-1)*p extra chunk-forwards,
    # and the doubled (p-r-1) absorbs the wrap-around delay of the later chunks.
    return min(2 * (p - rank - 1) + (v - 1) * p, m * v)


def _interleaved_order(p: int, v: int, rank: int, k: int, forward: bool) -> tuple[int, int]:
    """(global chunk, micro-batch) of the k-th forward (or backward) on `rank`."""
    local = (k // p) % v
    if not forward:
        local = v - 1 - local
    micro_batch = (k // (p * v)) * p + k % p
    return rank + local * p, micro_batch


def gpipe(layout, m: int, rank: int) -> list[tuple[str, int, int]]:
    """All m forwards, then all m backwards."""
    return [(F, rank, mb) for mb in range(m)] + [(B, rank, mb) for mb in range(m)]


def one_f_one_b(layout, m: int, rank: int) -> list[tuple[str, int, int]]:
    """1F1B, and over v > 1 chunks per rank interleaved 1F1B: warm-up forwards, one forward and one backward in
    turn, then the remaining backwards."""
    p, v = layout.pp, layout.vpp
    fwd = [(F, *_interleaved_order(p, v, rank, k, True)) for k in range(m * v)]
    bwd = [(B, *_interleaved_order(p, v, rank, k, False)) for k in range(m * v)]
    warmup = warmup_forwards(p, v, m, rank)
    order = fwd[:warmup]
    # Steady state: one forward then one backward, so in-flight activations stay at warmup + 1.
    for k in range(len(fwd) - warmup):
        order.append(fwd[warmup + k])
        order.append(bwd[k])
    order.extend(bwd[len(fwd) - warmup:])
    return order


def one_f_one_b_overlap(layout, m: int, rank: int) -> list[tuple]:
    """1F1B with one more warm-up forward; each steady-state forward is paired with the backward after it (v = 1)."""
    p = layout.pp
    warmup = min(2 * (p - rank - 1) + 1, m)
    order: list[tuple] = [(F, rank, mb) for mb in range(warmup)]
    for k in range(m - warmup):
        order += [(F, rank, warmup + k), (B, rank, k, PAIRED)]
    return order + [(B, rank, mb) for mb in range(m - warmup, m)]
