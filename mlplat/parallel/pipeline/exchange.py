"""How a rank's instruction list is posted to the transport: pure data, shared by the engine and the checker.

NCCL (DESIGN.md §7) ignores tags, matches the sends and receives of a pair of ranks in the order they are
posted, runs the operations of one communicator on one stream in posting order, and a send may not complete
before its receive has started. Posting each SEND/RECV on its own, or posting receives ahead of the computes
that precede them, can therefore cross two ranks' queues into a circular wait that gloo never shows (tagged
gloo matches by tag, whatever the order).

The rule here: the message instructions between two consecutive computes of a rank form one *exchange group*
- the SENDs of the compute that just ran and the RECVs of the compute about to run - posted together as one
`batch_isend_irecv` (one NCCL group, whose operations progress together) and, when it receives anything,
waited for right before that compute. That is the pairing of Megatron-Core's `send_forward_recv_backward` /
`send_backward_recv_forward`, derived from the schedule instead of written per schedule. Groups that only
send are waited for at the end of the step (their tensors must live until then).

The interleaved schedule (v > 1) needs Megatron's coarser unit: each steady-state forward and the backward
after it run back to back, with one group before the pair (both receives) and the pair's sends in the next
group. Per compute, interleaving's warm-up sends queue on the stream ahead of a receive the peer needs first,
and NCCL's FIFO closes a cycle (the checker finds one for every m >= 2p). Gpipe and 1f1b keep the per-compute
groups: pairing there would serialise every step on a round trip.

`mlplat.perf.transport.run_exchange` executes these plans under NCCL's rules and proves them free of deadlock
and of mismatched pairs for every schedule, p <= 8, v <= 4 (tests/test_exchange.py); the engine executes the
very same plans, with every tag 0, so on gloo too messages match by posting order only.
"""
from __future__ import annotations

from dataclasses import dataclass

from mlplat.parallel.pipeline.schedules import COMPUTE_OPS, Instruction, Op

RECV_OPS = (Op.RECV_ACT, Op.RECV_GRAD)
SEND_OPS = (Op.SEND_ACT, Op.SEND_GRAD)


@dataclass(frozen=True)
class Post:
    """Post `messages` as one group (one `batch_isend_irecv`); `group` numbers the rank's groups from 0."""
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


def exchange_plan(ops: list[Instruction], paired: bool = False) -> list[Step]:
    """The steps by which one rank executes its instruction list `ops` (in order).

    A *unit* is one compute, or with `paired` (the interleaved schedule, v > 1) a steady-state forward and the
    backward right after it. Before a unit, one group holds the sends of the previous unit and the receives of
    this one, and is waited for when it receives anything; groups that only send are waited for at the end.
    Within a group, operations are ordered by message, so the two sides of a pair post them alike."""
    computes = [i for i, ins in enumerate(ops) if ins.op in COMPUTE_OPS]
    backwards = [i for i in computes if ops[i].op is Op.BACKWARD]
    # A steady state exists when some forward runs after the first backward (at m = p interleaved rank 0 runs
    # every forward first: pairing its last warm-up forward with the first backward would wait for a gradient
    # that needs that very forward's activation).
    steady = paired and bool(backwards) and any(ops[i].op is Op.FORWARD and i > backwards[0] for i in computes)
    units: list[list[int]] = []
    for i in computes:
        if steady and units and ops[i].op is Op.BACKWARD and len(units[-1]) == 1 \
                and ops[units[-1][0]].op is Op.FORWARD:
            units[-1].append(i)
        else:
            units.append([i])

    def messages_around(i: int, step: int, kinds: tuple[Op, ...]) -> list[Instruction]:
        out, j = [], i + step
        while 0 <= j < len(ops) and ops[j].op not in COMPUTE_OPS:
            if ops[j].op in kinds:
                out.append(ops[j])
            j += step
        return out

    steps: list[Step] = []
    unwaited: list[int] = []  # send-only groups, waited for at the end of the step
    posted: list[int] = []
    sends: list[Instruction] = []

    def post(messages: list[Instruction], waited: bool) -> None:
        group = len(posted)
        posted.append(group)
        steps.append(Post(group, tuple(sorted(messages, key=message_of))))
        (steps.append(Wait(group)) if waited else unwaited.append(group))

    for unit in units:
        recvs = [m for i in unit for m in messages_around(i, -1, RECV_OPS)]
        if sends or recvs:
            post(sends + recvs, waited=bool(recvs))
        steps.extend(Compute(ops[i]) for i in unit)
        sends = [m for i in unit for m in messages_around(i, +1, SEND_OPS)]
    if sends:
        post(sends, waited=False)
    steps.extend(Wait(g) for g in unwaited)
    return steps


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
