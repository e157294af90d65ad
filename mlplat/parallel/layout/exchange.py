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
- sends are posted right after the compute that produced them; a channel holds at most SEND_WINDOW of them in
  flight: the oldest is waited for (and its buffer released) right before the channel's next send is posted,
  the rest at the end of the step. So the buffers a rank holds do not grow with m (`live_buffers`); waiting
  for every send only at the step's end held m of them (32 at m = 32 for 1F1B, 96 interleaved);
- receives are posted `lookahead` computes before the one that needs them and waited for right before it.
`mlplat.perf.transport` runs these plans under NCCL's rules, the host's included, for every schedule, p <= 8,
v <= 4 and m from 1 to 4p: no deadlock, and with free or costly transfers no step longer than with the sends
waited only at the end (a window of 1 deadlocks in two of those cases, so the window is 2). The same plans run
on gloo with every tag 0, so there too a message is matched by its place in its channel, as on NCCL.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, replace

from mlplat.parallel.layout.pipeline import PipelineLayout
from mlplat.parallel.layout.schedules import COMPUTE_OPS, Instruction, Op, build_schedule

RECV_OPS = (Op.RECV_ACT, Op.RECV_GRAD)
SEND_OPS = (Op.SEND_ACT, Op.SEND_GRAD)
SEND_WINDOW = 2  # sends of one channel in flight at most: an older one is waited for before another is posted


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


@dataclass(frozen=True)
class Create:
    """Create the communicator of the directed channel (src, dst): the host blocks until the other rank of the
    channel reaches its own Create of it (ProcessGroupNCCL's rendezvous and `ncclCommInitRank`)."""
    src: int
    dst: int

    def __str__(self) -> str:
        return f"CREATE({self.src}->{self.dst})"


@dataclass(frozen=True)
class Sync:
    """A device-wide synchronize: the host blocks until every operation this rank has posted has completed."""

    def __str__(self) -> str:
        return "SYNC"


@dataclass(frozen=True)
class Collective:
    """One collective operation, numbered `group` with the rank's posts, on the communicator of `ranks` (its members,
    world ranks), carrying `what`: the k-th collective of each member on that communicator is one operation (their
    `what` must agree), queued on the member's stream for that communicator in posting order, and complete once
    every member has started it (no member of an NCCL collective finishes before all have joined)."""
    group: int
    ranks: tuple[int, ...]
    what: str

    def __str__(self) -> str:
        return f"COLL#{self.group}[{self.what} on {self.ranks}]"


Step = Post | Wait | Compute | Create | Sync | Collective


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


def exchange_plans(schedule: list[list[Instruction]], lookahead: int = 1,
                   send_window: int | None = SEND_WINDOW) -> list[list[Step]]:
    """The exchange plan of every rank of `schedule` (one instruction list per pipeline rank)."""
    send_order: dict[tuple[int, int], list[tuple[str, int, int]]] = {}
    for src, ops in enumerate(schedule):
        for ins in ops:
            if ins.op in SEND_OPS:
                send_order.setdefault((src, ins.peer), []).append(message_of(ins))
    return [exchange_plan(ops, rank, {q: order for (q, dst), order in send_order.items() if dst == rank},
                          lookahead, send_window) for rank, ops in enumerate(schedule)]


def exchange_plan(ops: list[Instruction], rank: int, peer_sends: dict[int, list[tuple[str, int, int]]],
                  lookahead: int = 1, send_window: int | None = SEND_WINDOW) -> list[Step]:
    """The steps by which pipeline rank `rank` executes its instruction list `ops`; `peer_sends[q]` is the
    order in which rank q sends its messages to this rank."""
    computes = [i for i, ins in enumerate(ops) if ins.op in COMPUTE_OPS and not ins.paired]  # a pair is one
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
            consumer = bisect.bisect_right(computes, k)  # the first compute after the receive
            post_at.setdefault(computes[max(0, consumer - lookahead)], []).append(ins)

    steps: list[Step] = []
    group_of: dict[tuple[str, int, int], int] = {}
    sends: list[int] = []
    in_flight: dict[tuple[int, int], list[int]] = {}  # channel -> its sends not yet waited for, oldest first

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
            queue = in_flight.setdefault(channel(ins, rank), [])
            if send_window is not None and len(queue) >= send_window:
                steps.append(Wait(queue.pop(0)))  # its buffer is released before the channel takes another
            group = post(ins)
            sends.append(group)
            queue.append(group)
        else:
            steps.append(Compute(ins))
    steps.extend(Wait(g) for queue in in_flight.values() for g in queue)
    return steps


def live_buffers(plan: list[Step]) -> int:
    """The most message buffers a rank holds at once under `plan`: sends posted and not yet waited for, plus
    receives posted ahead of their wait (a received tensor is the next compute's input from then on)."""
    live, peak = set(), 0
    for step in plan:
        if isinstance(step, Post):
            live.add(step.group)
            peak = max(peak, len(live))
        elif isinstance(step, Wait):
            live.discard(step.group)
    return peak


def in_flight_messages(layout: PipelineLayout, m: int) -> int:
    """The most message buffers ([micro_batch, seq, hidden] or its 1/t slice) any pipeline rank of `layout`
    holds at once over a training step of m micro-batches. With SEND_WINDOW it does not grow with m."""
    if layout.pp < 2:
        return 0
    return max(map(live_buffers, exchange_plans(build_schedule(layout.schedule, layout.pp, layout.vpp, m))))


def channel_rounds(pp: int) -> list[list[tuple[int, int]]]:
    """The directed channels (src, dst) of a pipeline of pp ranks, in rounds in which no rank is in two pairs:
    the pairs {r, r+1} with r even, then r odd, then the wrap-around pair {p-1, 0} when p is odd."""
    pairs = sorted({tuple(sorted((r, (r + 1) % pp))) for r in range(pp)}) if pp > 1 else []
    rounds: list[list[tuple[int, int]]] = [[], [], []]
    for lo, hi in pairs:
        wrap = (lo, hi) == (0, pp - 1) and pp > 2
        rounds[(2 if pp % 2 else 1) if wrap else lo % 2] += [(lo, hi), (hi, lo)]
    return [r for r in rounds if r]


def with_communicators(plans: list[list[Step]]) -> list[list[Step]]:
    """The plans preceded by the creation of every channel's communicator in `channel_rounds` order, as
    `mlplat.parallel.communicators` does when the grid is built."""
    order = [ch for round_ in channel_rounds(len(plans)) for ch in round_]
    return [[Create(a, b) for a, b in order if r in (a, b)] + plan for r, plan in enumerate(plans)]


def replicated(plans: list[list[Step]], replicas: int) -> list[list[Step]]:
    """`replicas` copies of one pipeline's plans (the data- or context-parallel replicas of each stage run the same
    schedule): world rank replica·p + pipeline rank, each copy's messages and channels within its own replica."""
    p = len(plans)

    def moved(step: Step, base: int) -> Step:
        if isinstance(step, Post):
            return Post(step.group, tuple(replace(i, peer=i.peer + base) for i in step.messages))
        if isinstance(step, Create):
            return Create(step.src + base, step.dst + base)
        return step

    return [[moved(step, d * p) for step in plan] for d in range(replicas) for plan in plans]


def paired_collectives(forward: tuple[str, ...], backward: tuple[str, ...], hands_over: bool) -> list[tuple]:
    """The order in which a combined forward and backward (a paired B, `mlplat.parallel.pipeline.pair`) post and wait
    for their collectives on one communicator: ("post" | "wait", "F" | "B", index). Handing over at each post
    (`hands_over`), the forward runs to its first post, the backward to its first, then each waits for its own
    collective when its turn comes back and runs to its next post; a side that has finished hands over no more, so
    the other waits for each of its collectives at once. Without handing over: the forward's, then the backward's."""
    if not hands_over:
        return [(what, "F", k) for k in range(len(forward)) for what in ("post", "wait")] + \
               [(what, "B", k) for k in range(len(backward)) for what in ("post", "wait")]

    def side(name: str, n: int):
        for k in range(n):
            yield "post", name, k
            yield None  # hand over
            yield "wait", name, k

    runs = {"F": side("F", len(forward)), "B": side("B", len(backward))}
    out, turn = [], "F"
    while runs:
        step = next(runs[turn], "done")
        other = "B" if turn == "F" else "F"
        if step == "done":
            del runs[turn]
            turn = other
        elif step is None:
            turn = other if other in runs else turn
        else:
            out.append(step)
    return out


def with_stage_collectives(plans: list[list[Step]], p: int, size: int, forward: tuple[str, ...],
                           backward: tuple[str, ...], hands_over: bool = False) -> list[list[Step]]:
    """`replicated` plans (world rank replica·p + pipeline rank) with the collectives a layer's computes post on a
    group of `size` consecutive replicas of its stage (world ranks r, r + p, ...): `forward` in each F, `backward`
    in each B (a dispatcher's, `mlplat.specs.dispatchers.Dispatcher.collectives`), each named with its compute and
    waited for by the host at once; a paired B's and its F's interleaved as `paired_collectives` says (`hands_over`:
    the dispatcher's). That is stricter than a GPU, whose compute stream waits for a collective while its host goes
    on: a plan free of deadlock here is free of it there."""
    out = []
    for w, plan in enumerate(plans):
        stage, first = w % p, w // p - w // p % size
        ranks = tuple((first + j) * p + stage for j in range(size))
        group = 1 + max((x.group for x in plan if isinstance(x, Post)), default=-1)
        steps: list[Step] = []
        for i, step in enumerate(plan):
            if not (isinstance(step, Compute) and step.instruction.op in (Op.FORWARD, Op.BACKWARD)):
                steps.append(step)
                continue
            ins = step.instruction
            if ins.paired:
                continue  # posted with its F
            after = plan[i + 1] if i + 1 < len(plan) else None
            if isinstance(after, Compute) and after.instruction.paired:
                names = {"F": [f"{what} {ins}" for what in forward],
                         "B": [f"{what} {after.instruction}" for what in backward]}
                numbers = {}
                for what, side, k in paired_collectives(forward, backward, hands_over):
                    if what == "post":
                        numbers[side, k] = group
                        steps.append(Collective(group, ranks, names[side][k]))
                        group += 1
                    else:
                        steps.append(Wait(numbers[side, k]))
                steps += [step, after]
                continue
            for what in forward if ins.op is Op.FORWARD else backward:
                steps += [Collective(group, ranks, f"{what} {ins}"), Wait(group)]
                group += 1
            steps.append(step)
        out.append(steps)
    return out
