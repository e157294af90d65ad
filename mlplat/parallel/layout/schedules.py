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

Schedules. Each is an entry of `registry` (its name, placement, order function, bubble, rules and label):
gpipe, 1f1b, 1f1b_overlap and interleaved order their passes in `orders.py`, the zero-bubble schedules zb_h1, zb_h2,
zbv and v_half in `zero_bubble.py`. A rank's order (F, B and W per chunk and micro-batch) becomes its instruction
list here, with the messages inserted around it. A B marked `paired` (1f1b_overlap) runs combined with the F just
before it: the pair is one compute for the messages, both its receives before the F, both its sends after the B.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from mlplat.parallel.layout.pipeline import PipelineLayout
from mlplat.parallel.layout.registry import get

__all__ = ["COMPUTE_OPS", "Op", "Instruction", "build_schedule", "rank_schedule", "validate_schedule_args",
           "paper_bubble"]


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
    paired: bool = False  # a B run combined with the F just before it (the registry entry's `pairs`)

    def __str__(self) -> str:
        peer = "" if self.peer is None else f"<->{self.peer}"
        return f"{'+' if self.paired else ''}{self.op.value}(c{self.chunk},mb{self.micro_batch}{peer})"


def validate_schedule_args(kind: str, p: int, v: int, m: int) -> None:
    """Refuse an impossible (schedule, p, v, m) with one line naming key, value and rule."""
    problems = PipelineLayout(p, v, kind).violations()
    problems = problems or PipelineLayout(p, v, kind).micro_batch_violations(m)
    if problems:
        raise ValueError(problems[0])


def paper_bubble(kind: str, p: int, v: int, m: int) -> float:
    """The papers' bubble fraction of `kind` at (p, v, m), from its registry entry; the simulator measures the
    real one."""
    return get(kind).bubble(p, v, m)


def _compute_order(layout: PipelineLayout, m: int, rank: int) -> list[Instruction]:
    """The rank's F/B(/W) sequence, before messages are inserted."""
    return [Instruction(Op(op), c, mb, paired=bool(rest and rest[0]))
            for op, c, mb, *rest in layout.spec.order(layout, m, rank)]


def _with_messages(order: list[Instruction], layout: PipelineLayout) -> list[Instruction]:
    """Wrap each compute with the RECV it needs (just before) and the SEND it feeds (just after); a paired B and
    its F as one compute."""
    last, owner = layout.last_chunk, [layout.owner(c) for c in range(layout.num_chunks)]
    units: list[list[Instruction]] = []
    for ins in order:
        if ins.paired:
            units[-1].append(ins)
        else:
            units.append([ins])
    out: list[Instruction] = []
    for unit in units:
        recvs, sends = [], []
        for ins in unit:
            c, mb = ins.chunk, ins.micro_batch
            rank = owner[c]
            if ins.op is Op.FORWARD:
                if c > 0 and owner[c - 1] != rank:
                    recvs.append(Instruction(Op.RECV_ACT, c, mb, owner[c - 1]))
                if c < last and owner[c + 1] != rank:
                    sends.append(Instruction(Op.SEND_ACT, c, mb, owner[c + 1]))
            elif ins.op is Op.BACKWARD:
                if c < last and owner[c + 1] != rank:
                    recvs.append(Instruction(Op.RECV_GRAD, c, mb, owner[c + 1]))
                if c > 0 and owner[c - 1] != rank:
                    sends.append(Instruction(Op.SEND_GRAD, c, mb, owner[c - 1]))
        out += recvs + unit + sends
    return out


def rank_schedule(kind: str, p: int, v: int, m: int, rank: int) -> list[Instruction]:
    """Instruction list of one pipeline rank, in execution order."""
    validate_schedule_args(kind, p, v, m)
    if not 0 <= rank < p:
        raise ValueError(f"pipeline rank {rank} is outside [0, parallel.pp={p})")
    layout = PipelineLayout(p, v, kind)
    return _with_messages(_compute_order(layout, m, rank), layout)


def build_schedule(kind: str, p: int, v: int, m: int) -> list[list[Instruction]]:
    """One instruction list per pipeline rank, each in execution order."""
    validate_schedule_args(kind, p, v, m)
    return [rank_schedule(kind, p, v, m, r) for r in range(p)]
