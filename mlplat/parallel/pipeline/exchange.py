"""How a rank's instruction list is posted to the transport: pure data, shared by the engine and the checker.

NCCL ignores tags, matches the sends and receives of a pair of ranks in the order they are
posted, runs the operations of one communicator on one stream in posting order, and a send may not complete
before its receive has started. With one communicator for all pipeline traffic, a send queued behind a receive
(or the other way round) couples the two directions of a pair and the ranks' orders into cycles that gloo
never shows (the previous engine's order deadlocks so: tests/parallel/pipeline/test_exchange.py).

Directed channels. Every direction of every pair of neighbouring stages has a communicator of its own
(`ParallelGrid.p2p_group(src, dst)`), carrying only the messages from src to dst. Then
- a send can queue only behind earlier sends of the same channel, never behind a receive;
- the receiver posts its receives from a channel in the order the sender sends on it (a receive that the
  sender sends before one needed now is posted with it, early; its data was sent first, so this costs no wait);
- sends are posted right after the compute that produced them and waited for at the end of the step, receives
  are posted `lookahead` computes before the one that needs them and waited for right before it.
Nothing waits on a send before the step ends, so a rank blocks only where the schedule itself blocks (a RECV),
and the transport adds no cycle to a schedule that has none: with free transfers, `mlplat.perf.transport`
times these plans exactly as the ideal simulator times the schedule, for every schedule. The same plans run on
gloo with every tag 0, so there too a message is matched by its place in its channel, as on NCCL.
"""
from __future__ import annotations

from dataclasses import dataclass

from mlplat.parallel.pipeline.schedules import COMPUTE_OPS, Instruction, Op

RECV_OPS = (Op.RECV_ACT, Op.RECV_GRAD)
SEND_OPS = (Op.SEND_ACT, Op.SEND_GRAD)


@dataclass(frozen=True)
class Post:
    """Post `messages` together, as one group whose operations progress together (one NCCL group); `group`
    numbers the rank's posts from 0. The exchange plans below post one message at a time; the transport model
    also takes groups of several (e.g. Megatron's batched pairs, or the previous engine's order)."""
    group: int
    messages: tuple[Instruction, ...]

    def __str__(self) -> str:
        return f"POST#{self.group}[{' '.join(map(str, self.messages))}]"


@dataclass(frozen=True)
class Wait:
    """Block until every operation of `group` has completed."""
    group: int

    def __str__(self) -> str:
        return f"WAIT#{self.group}"


@dataclass(frozen=True)
class Compute:
    instruction: Instruction

    def __str__(self) -> str:
        return str(self.instruction)


Step = Post | Wait | Compute


def channel(ins: Instruction, rank: int) -> tuple[int, int]:
    """The directed channel (sender, receiver) - pipeline ranks - of a SEND or RECV of `rank`."""
    return (rank, ins.peer) if ins.op in SEND_OPS else (ins.peer, rank)


def message_of(ins: Instruction) -> tuple[str, int, int]:
    """What a SEND or RECV carries, as (kind, receiving chunk, micro-batch): the pair of a send and the
    receive it must match have the same message."""
    if ins.op is Op.SEND_ACT:
        return "act", ins.chunk + 1, ins.micro_batch
    if ins.op is Op.SEND_GRAD:
        return "grad", ins.chunk - 1, ins.micro_batch
    if ins.op is Op.RECV_ACT:
        return "act", ins.chunk, ins.micro_batch
    if ins.op is Op.RECV_GRAD:
        return "grad", ins.chunk, ins.micro_batch
    raise ValueError(f"{ins} is not a message")


def exchange_plans(schedule: list[list[Instruction]], lookahead: int = 1) -> list[list[Step]]:
    """The exchange plan of every rank of `schedule` (one instruction list per pipeline rank)."""
    send_order: dict[tuple[int, int], list[tuple[str, int, int]]] = {}
    for src, ops in enumerate(schedule):
        for ins in ops:
            if ins.op in SEND_OPS:
                send_order.setdefault((src, ins.peer), []).append(message_of(ins))
    return [exchange_plan(ops, rank, {q: order for (q, dst), order in send_order.items() if dst == rank},
                          lookahead) for rank, ops in enumerate(schedule)]


def exchange_plan(ops: list[Instruction], rank: int, peer_sends: dict[int, list[tuple[str, int, int]]],
                  lookahead: int = 1) -> list[Step]:
    """The steps by which pipeline rank `rank` executes its instruction list `ops`; `peer_sends[q]` is the
    order in which rank q sends its messages to this rank."""
    computes = [i for i, ins in enumerate(ops) if ins.op in COMPUTE_OPS]
    recv_of = {message_of(i): i for i in ops if i.op in RECV_OPS}
    for msg, ins in recv_of.items():
        if msg not in peer_sends.get(ins.peer, ()):
            raise ValueError(f"rank {rank}: {ins} has no matching send on rank {ins.peer}")
    position = {q: {msg: k for k, msg in enumerate(order)} for q, order in peer_sends.items()}
    taken = {q: 0 for q in peer_sends}  # how many of q's messages have a receive posted

    # The compute before which each receive is posted: `lookahead` computes before the one that needs it.
    post_at: dict[int, list[Instruction]] = {}
    for k, ins in enumerate(ops):
        if ins.op in RECV_OPS:
            consumer = next(j for j, c in enumerate(computes) if c > k)
            post_at.setdefault(computes[max(0, consumer - lookahead)], []).append(ins)

    steps: list[Step] = []
    group_of: dict[tuple[str, int, int], int] = {}
    sends: list[int] = []

    def post(ins: Instruction) -> int:
        group = len(group_of) + len(sends)
        steps.append(Post(group, (ins,)))
        return group

    def post_receive(ins: Instruction) -> None:
        q, k = ins.peer, position[ins.peer][message_of(ins)]
        while taken[q] <= k:  # earlier messages of the channel first: matching is by order
            msg = peer_sends[q][taken[q]]
            group_of[msg] = post(recv_of[msg])
            taken[q] += 1

    for k, ins in enumerate(ops):
        for early in post_at.get(k, ()):
            post_receive(early)
        if ins.op in RECV_OPS:
            post_receive(ins)  # a no-op when posted ahead
            steps.append(Wait(group_of[message_of(ins)]))
        elif ins.op in SEND_OPS:
            sends.append(post(ins))
        else:
            steps.append(Compute(ins))
    steps.extend(Wait(g) for g in sends)
    return steps
