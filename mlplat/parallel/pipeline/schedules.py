"""Pipeline schedules as pure data: (schedule, p, v, m, rank) -> list of instructions.

This is the single source of truth for a schedule: the engine executes these lists, the simulator
(`mlplat.perf.simulator`) times them, the timeline plot draws them and the tests check them.
No torch here, so all of that runs anywhere.

Model. The model is cut into p*v chunks (virtual stages), placed on the ranks by `layout.PipelineLayout`: chunk c
on pipeline rank c % p, so rank r holds chunks r, r+p, ..., r+(v-1)p (zbv: a V). The forward of a micro-batch
flows through chunks 0..p*v-1 and its backward the reverse. With v > 1 the last rank's chunk c feeds rank 0's
chunk c+1 (wrap-around).

Messages. SEND is non-blocking (isend; the data lands one transfer time later). RECV blocks until the
matching message has arrived. Each RECV sits right before the compute that needs it and each SEND right
after the compute that produced it, so an engine that posts receives early still has these semantics.
  SEND_ACT(c, mb, peer)   output of F(c, mb) -> chunk c+1 on rank `peer`; matches RECV_ACT(c+1, mb, sender)
  SEND_GRAD(c, mb, peer)  grad w.r.t. chunk c's input after B(c, mb) -> chunk c-1; matches
                          RECV_GRAD(c-1, mb, sender), i.e. the grad w.r.t. chunk c-1's output
Messages exist only between different ranks (p = 1 gives lists of F/B only). Chunk 0's F reads the data
loader; chunk p*v-1's F computes the loss and its B starts the backward without any RECV_GRAD.

Schedules (paper, Section 2.2).
  gpipe        all m forwards, then all m backwards (v = 1). Peak in flight: m on every rank.
  1f1b         PipeDream-Flush: rank r runs w_r = min(p-r-1, m) warm-up forwards, then alternates one
               forward and one backward, then drains the remaining backwards (v = 1).
               Peak in flight: min(p-r, m) micro-batches on rank r.
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

import enum
from dataclasses import dataclass

from mlplat.parallel.pipeline.layout import SCHEDULES, ZERO_BUBBLE, PipelineLayout

__all__ = ["SCHEDULES", "ZERO_BUBBLE", "COMPUTE_OPS", "Op", "Instruction", "build_schedule", "rank_schedule",
           "validate_schedule_args", "paper_bubble", "warmup_forwards"]


class Op(str, enum.Enum):
    FORWARD = "F"
    BACKWARD = "B"
    SEND_ACT = "SEND_ACT"
    RECV_ACT = "RECV_ACT"
    SEND_GRAD = "SEND_GRAD"
    RECV_GRAD = "RECV_GRAD"
    WEIGHT = "W"  # zero-bubble schedules: the weight gradients of a chunk's backward, deferred


COMPUTE_OPS = (Op.FORWARD, Op.BACKWARD, Op.WEIGHT)


@dataclass(frozen=True)
class Instruction:
    op: Op
    chunk: int  # GLOBAL model chunk (virtual stage) id; it lives on rank PipelineLayout.owner(chunk)
    micro_batch: int
    peer: int | None = None  # pipeline rank of the other side, for send/recv only

    def __str__(self) -> str:
        peer = "" if self.peer is None else f"<->{self.peer}"
        return f"{self.op.value}(c{self.chunk},mb{self.micro_batch}{peer})"


def validate_schedule_args(kind: str, p: int, v: int, m: int) -> None:
    """Refuse an impossible (schedule, p, v, m) with one line naming key, value and rule."""
    problems = PipelineLayout(p, v, kind).violations()
    problems = problems or PipelineLayout(p, v, kind).micro_batch_violations(m)
    if problems:
        raise ValueError(problems[0])


def paper_bubble(kind: str, p: int, v: int, m: int) -> float:
    """The papers' bubble fraction: (p-1)/m (gpipe, 1f1b), (p-1)/(v*m) (interleaved), (p-1)/(3m) for ZB-H1,
    about 0 for ZB-V and ZB-H2 (Qi et al., at F = B = W; ZB-H2's across steps, with optimizer post-validation),
    and for V-Half 1F1B's, which Qi et al. 2024 compare it with; the simulator measures the real one."""
    if kind == "zb_h1":
        return (p - 1) / (3 * m)
    if kind in ("zbv", "zb_h2"):
        return 0.0
    return (p - 1) / (m * (v if kind == "interleaved" else 1))


def warmup_forwards(kind: str, p: int, v: int, m: int, rank: int) -> int:
    """Number of forwards rank `rank` runs before its first backward."""
    if kind == "gpipe":
        return m
    if kind == "1f1b" or v == 1:
        # Rank r must keep forwarding until the first gradient can come back from the p-r-1 ranks after it.
        return min(p - rank - 1, m)
    # Interleaved: the first backward on rank r needs micro-batch 0 to go through all v*p chunks and come
    # back; Megatron's count (paper, Section 2.2.2) covers that with the (v-1)*p extra chunk-forwards,
    # and the doubled (p-r-1) absorbs the wrap-around delay of the later chunks.
    return min(2 * (p - rank - 1) + (v - 1) * p, m * v)


def _interleaved_order(p: int, v: int, m: int, rank: int, k: int, forward: bool) -> tuple[int, int]:
    """(global chunk, micro-batch) of the k-th forward (or backward) on `rank`."""
    local = (k // p) % v
    if not forward:
        local = v - 1 - local
    micro_batch = (k // (p * v)) * p + k % p
    return rank + local * p, micro_batch


def _compute_order(kind: str, p: int, v: int, m: int, rank: int) -> list[tuple[Op, int, int]]:
    """The rank's F/B(/W) sequence as (op, chunk, micro_batch), before messages are inserted."""
    if kind in ZERO_BUBBLE:
        from mlplat.parallel.pipeline.zero_bubble import zero_bubble_orders

        return [(Op(op), c, mb) for op, c, mb in zero_bubble_orders(kind, p, m)[rank]]
    if kind == "interleaved" and v > 1:
        fwd = [(Op.FORWARD, *_interleaved_order(p, v, m, rank, k, True)) for k in range(m * v)]
        bwd = [(Op.BACKWARD, *_interleaved_order(p, v, m, rank, k, False)) for k in range(m * v)]
    else:
        fwd = [(Op.FORWARD, rank, mb) for mb in range(m)]
        bwd = [(Op.BACKWARD, rank, mb) for mb in range(m)]
    warmup = warmup_forwards(kind, p, v, m, rank)
    order = fwd[:warmup]
    # Steady state: one forward then one backward, so in-flight activations stay at warmup + 1.
    for k in range(len(fwd) - warmup):
        order.append(fwd[warmup + k])
        order.append(bwd[k])
    order.extend(bwd[len(fwd) - warmup:])
    return order


def _with_messages(order: list[tuple[Op, int, int]], layout: PipelineLayout) -> list[Instruction]:
    """Wrap each compute with the RECV it needs (just before) and the SEND it feeds (just after)."""
    last, owner = layout.last_chunk, layout.owner
    out: list[Instruction] = []
    for op, c, mb in order:
        rank = owner(c)
        if op is Op.FORWARD:
            if c > 0 and owner(c - 1) != rank:
                out.append(Instruction(Op.RECV_ACT, c, mb, owner(c - 1)))
            out.append(Instruction(Op.FORWARD, c, mb))
            if c < last and owner(c + 1) != rank:
                out.append(Instruction(Op.SEND_ACT, c, mb, owner(c + 1)))
        elif op is Op.BACKWARD:
            if c < last and owner(c + 1) != rank:
                out.append(Instruction(Op.RECV_GRAD, c, mb, owner(c + 1)))
            out.append(Instruction(Op.BACKWARD, c, mb))
            if c > 0 and owner(c - 1) != rank:
                out.append(Instruction(Op.SEND_GRAD, c, mb, owner(c - 1)))
        else:
            out.append(Instruction(Op.WEIGHT, c, mb))
    return out


def rank_schedule(kind: str, p: int, v: int, m: int, rank: int) -> list[Instruction]:
    """Instruction list of one pipeline rank, in execution order."""
    validate_schedule_args(kind, p, v, m)
    if not 0 <= rank < p:
        raise ValueError(f"pipeline rank {rank} is outside [0, parallel.pp={p})")
    return _with_messages(_compute_order(kind, p, v, m, rank), PipelineLayout(p, v, kind))


def build_schedule(kind: str, p: int, v: int, m: int) -> list[list[Instruction]]:
    """One instruction list per pipeline rank, each in execution order."""
    validate_schedule_args(kind, p, v, m)
    return [rank_schedule(kind, p, v, m, r) for r in range(p)]
