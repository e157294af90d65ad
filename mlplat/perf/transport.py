"""A model of NCCL's point-to-point semantics that runs the engine's posting plans and times them.

The rules, as this model applies them:
- no tags: the k-th send from rank a to rank b matches the k-th receive posted on b from a, whatever either
  carries; a pair whose messages differ is a *mismatch* (silent corruption on NCCL, or on tag-free gloo);
- a group (one post: one operation, or several as one `batch_isend_irecv`) is queued on a stream when its rank
  posts it; a stream runs its groups one after the other in posting order. `streams="channel"`: one communicator
  per direction of a pair, so an operation queues only behind the earlier ones of its own direction (what mlplat's
  engine uses: `exchange.py`); `streams="pair"`: one per pair of ranks, both directions sharing it (one process
  group for all pipeline traffic, with PyTorch's per-pair communicators); `streams="rank"`: one per rank for all
  its peers (batched p2p on a process group's own communicator);
- the operations of a started group progress together; a send and its receive complete together, only once
  both their groups have started (a send may block until its receive is posted, as past NCCL's buffering);
  a group completes when all of its operations have;
- a rank's host runs its steps in order: a POST costs nothing, a compute its cost, a WAIT blocks until the
  group has completed. (On a GPU a wait blocks the compute stream, not the host, so receive-only groups
  could start earlier than here; starting earlier never creates a wait-for cycle, so a plan free of
  deadlock here is free of it there.)
- a collective (`exchange.Collective`: the expert dispatch's, beside the pipeline's transfers) queues on its rank's
  stream of its communicator; the k-th collective of every member of a communicator is one operation, which
  completes once all of them have started it (a member that never posts it leaves the others waiting);
- the host blocks too: a CREATE of a channel's communicator waits until the channel's other rank reaches its
  CREATE (with `lazy=True` every channel's first post creates it, as ProcessGroupNCCL does without
  `device_id`), and a SYNC (`torch.cuda.synchronize()`) waits until every group the rank posted has completed.

Because every start and completion time is a max over already-determined times, the ranks and groups can be
resolved in any order; when nothing can move while ranks are unfinished, the plan deadlocks and the report
names each stuck rank, the group it waits on, and for each unmatched operation the peer and what blocks it.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from mlplat.parallel.layout.exchange import (
    RECV_OPS,
    Collective,
    Compute,
    Create,
    Post,
    Step,
    Sync,
    Wait,
    channel,
    message_of,
)
from mlplat.parallel.layout.schedules import Instruction

ComputeCost = Callable[[int, Instruction], float]        # (rank, F/B instruction) -> seconds
TransferCost = Callable[[int, int, str], float]          # (src, dst, "act" | "grad"), (rank, rank, "collective")


class MismatchError(ValueError):
    """A send and the receive it matches by posting order carry different messages."""


@dataclass
class TransportResult:
    step_time: float                       # inf on deadlock
    finish: list[float]                    # per rank: when its last step ended
    busy: list[float]                      # per rank: pure compute time
    compute_spans: list[tuple[int, Instruction, float, float]]  # (rank, F/B, start, end)
    wait_spans: list[tuple[int, int, float, float]]             # (rank, group, start, end) of each WAIT
    deadlock: bool = False
    stuck: dict[int, str] = field(default_factory=dict)         # rank -> the step it cannot get past
    report: list[str] = field(default_factory=list)             # one line per stuck rank and blocked group
    stuck_at: dict[int, Step] = field(default_factory=dict)     # rank -> that step itself
    posted: dict[tuple[int, int], float] = field(default_factory=dict)  # (rank, group) -> when its rank posted it


@dataclass
class _Op:
    rank: int
    group: int               # the rank's group number
    ins: Instruction | Collective
    peer: int
    kind: str = ""           # what the send of the matched pair carries: "act" | "grad"; "collective"
    partner: "_Op | None" = None
    done: float | None = None
    members: "list[_Op] | None" = None  # a collective's operation on every member, this one's included


@dataclass(frozen=True)
class Exchange:
    """The static part of a run: the plans, their groups' operations matched by posting order, and the streams each
    group queues on. `prepare` builds it once for a plan timed under many cost models (the CPU model's fixed point);
    `run_exchange` accepts it in place of the plans."""

    plans: list[list[Step]]
    ops_of: dict[tuple[int, int], list[_Op]]          # (rank, group) -> its operations
    keys_of: dict[tuple[int, int], list[tuple[int, ...]]]  # (rank, group) -> the streams it queues on
    streams: str
    lazy: bool


# "ideal": no stream, no NCCL rule: a group starts when posted, a receive takes the send of its message (as with
# tags), and a send costs its rank nothing and lands `transfer` later (`mlplat.perf.simulator.simulate`).
STREAMS = ("rank", "pair", "channel", "ideal")


def _by_message(sends: list[_Op], recvs: list[_Op], outbox: dict) -> tuple[list[_Op], list[_Op]]:
    """One pair's sends and receives matched by message, in matching order (a send or receive left out has no
    counterpart: the receive never completes); a message sent twice, or sent by another rank than the receive
    names, is an error."""
    by_message: dict = {}
    for op in sends:
        if message_of(op.ins) in by_message:
            raise ValueError(f"rank {op.rank}: {op.ins} sends a message that was already sent")
        by_message[message_of(op.ins)] = op
    matched = [(by_message.pop(message_of(rv.ins)), rv) for rv in recvs if message_of(rv.ins) in by_message]
    taken = {id(rv) for _, rv in matched}
    for rv in recvs:
        if id(rv) not in taken:
            senders = [src for (src, dst), ops in outbox.items() if dst == rv.rank and src != rv.peer
                       and any(message_of(o.ins) == message_of(rv.ins) for o in ops)]
            if senders:
                raise ValueError(f"rank {rv.rank}: {rv.ins} expects peer {rv.peer} but rank {senders[0]} sent it")
    return [s for s, _ in matched], [r for _, r in matched]


def prepare(plans: list[list[Step]], streams: str = "channel", lazy: bool = False) -> Exchange:
    """Match every send with its receive (MismatchError if they carry different messages) and place each group on
    its streams: see `run_exchange` for `streams` and `lazy`."""
    if streams not in STREAMS:
        raise ValueError(f"streams={streams!r} must be one of {', '.join(map(repr, STREAMS))}")
    if lazy:
        plans = [_created_at_first_use(plan, r) for r, plan in enumerate(plans)]
    ops_of: dict[tuple[int, int], list[_Op]] = {}
    outbox: dict[tuple[int, int], list[_Op]] = {}  # (src, dst) -> sends in posting order
    inbox: dict[tuple[int, int], list[_Op]] = {}   # (src, dst) -> receives in posting order
    collectives: dict[tuple[tuple[int, ...], int], list[_Op]] = {}  # (communicator, rank) -> its collectives
    for r, plan in enumerate(plans):
        for step in plan:
            if isinstance(step, Post):
                ops = []
                for ins in step.messages:
                    op = _Op(r, step.group, ins, ins.peer)
                    ops.append(op)
                    (inbox if ins.op in RECV_OPS else outbox).setdefault(
                        (ins.peer, r) if ins.op in RECV_OPS else (r, ins.peer), []).append(op)
                ops_of[(r, step.group)] = ops
            elif isinstance(step, Collective):
                op = _Op(r, step.group, step, r, kind="collective")
                ops_of[(r, step.group)] = [op]
                collectives.setdefault((step.ranks, r), []).append(op)
    for (ranks, r), ops in collectives.items():
        if r != ranks[0]:
            continue
        for k, op in enumerate(ops):  # the k-th on the communicator of every member is one operation
            members = [mine[k] for mine in (collectives.get((ranks, q), []) for q in ranks) if len(mine) > k]
            if len(members) < len(ranks):
                continue  # a member never posts it: it never completes
            for m in members:
                if m.ins.what != op.ins.what:
                    raise MismatchError(f"collective #{k} on the communicator of ranks {ranks} is {op.ins.what!r} on "
                                        f"rank {r} but {m.ins.what!r} on rank {m.rank}")
                m.members = members
    for pair in set(outbox) | set(inbox):
        sends, recvs = outbox.get(pair, []), inbox.get(pair, [])
        if streams == "ideal":  # tagged: each receive takes the send of its message, whatever the posting order
            sends, recvs = _by_message(sends, recvs, outbox)
        for k, (s, rv) in enumerate(zip(sends, recvs)):
            message = message_of(s.ins)
            if message != message_of(rv.ins):
                raise MismatchError(
                    f"send #{k} from rank {pair[0]} to rank {pair[1]} is {s.ins} but the receive it matches on "
                    f"rank {pair[1]} is {rv.ins}: without tags the data lands in the wrong buffer")
            s.partner, rv.partner = rv, s
            s.kind = rv.kind = message[0]

    def streams_of(r: int, g: int) -> list[tuple[int, ...]]:
        if streams == "ideal":
            return []
        if isinstance(ops_of[(r, g)][0].ins, Collective):
            return [(r, -1, *ops_of[(r, g)][0].ins.ranks)]  # the rank's stream of that communicator
        if streams == "rank":
            return [(r,)]
        if streams == "pair":
            return sorted({(r, op.peer) for op in ops_of[(r, g)]})
        # one communicator per direction of a pair: a send from a to b and its receive share stream (a, b)
        return sorted({(r, r, op.peer) if op.ins.op not in RECV_OPS else (r, op.peer, r) for op in ops_of[(r, g)]})

    return Exchange(plans, ops_of, {key: streams_of(*key) for key in ops_of}, streams, lazy)


def run_exchange(plans: list[list[Step]] | Exchange, compute: ComputeCost | float = 1.0,
                 transfer: TransferCost | float = 0.0, streams: str = "channel", lazy: bool = False) -> TransportResult:
    """Execute one plan per pipeline rank (e.g. `exchange.exchange_plans(schedule)`), or a prepared `Exchange` (whose
    own `streams` and `lazy` then apply). lazy: a channel's communicator is created at its first use, unless a
    Create step made it earlier (ProcessGroupNCCL without `device_id`): the host blocks there until the channel's
    other rank reaches its own first use."""
    ex = plans if isinstance(plans, Exchange) else prepare(plans, streams, lazy)
    for ops in ex.ops_of.values():  # a prepared exchange is run again and again
        for op in ops:
            op.done = None
    cost = compute if callable(compute) else (lambda r, ins, c=float(compute): c)
    xfer = transfer if callable(transfer) else (lambda a, b, k, t=float(transfer): t)
    return _Run(ex, cost, xfer).run()


class _Run:
    """One run of an `Exchange`: the hosts' steps (`advance`) and the groups' life on their streams (posted,
    started once every earlier group of its streams completed, completed once its operations have)."""

    def __init__(self, ex: Exchange, cost: ComputeCost, xfer: TransferCost):
        self.plans, self.ops_of, self.keys_of, self.cost, self.xfer = ex.plans, ex.ops_of, ex.keys_of, cost, xfer
        self.eager = ex.streams == "ideal"  # a send needs no receive posted: it lands `transfer` after it starts
        p = len(self.plans)
        self.posted: dict[tuple[int, int], float] = {}
        self.started: dict[tuple[int, int], float] = {}
        self.completed: dict[tuple[int, int], float] = {}
        self.queue_of: dict[tuple[int, ...], list[tuple[int, int]]] = {}  # stream -> groups in posting order
        self.prev_in: dict[tuple[tuple[int, ...], tuple[int, int]], tuple[int, int] | None] = {}
        self.next_in: dict[tuple[tuple[int, ...], tuple[int, int]], tuple[int, int]] = {}
        self.work: deque = deque()
        self.arrived: dict[tuple[int, int, int], float] = {}  # (src, dst, rank): when the rank reached its Create
        self.posted_by: list[list[tuple[int, int]]] = [[] for _ in range(p)]
        self.pc, self.clock, self.busy = [0] * p, [0.0] * p, [0.0] * p
        self.compute_spans: list = []
        self.wait_spans: list = []
        self.waiting_since: dict[int, float] = {}

    # -- the groups ------------------------------------------------------------------------------------------
    def try_start(self, key: tuple[int, int]) -> None:
        if key in self.started or key not in self.posted:
            return
        t = self.posted[key]
        for s in self.keys_of[key]:
            prev = self.prev_in[(s, key)]
            if prev is not None:
                if prev not in self.completed:
                    return
                t = max(t, self.completed[prev])
        self.started[key] = t
        for op in self.ops_of[key]:
            self.try_complete(op)
        self.check_group(key)

    def try_complete(self, op: _Op) -> None:
        if op.done is not None:
            return
        started = self.started
        if op.kind == "collective":
            keys = [(m.rank, m.group) for m in op.members or ()]
            if not keys or any(k not in started for k in keys):
                return
            end = max(started[k] for k in keys) + self.xfer(op.rank, op.rank, op.kind)
            for m in op.members:
                m.done = end
            self.work.extend(keys)  # every member's group may now be complete
            return
        if self.eager:
            return self._complete_eagerly(op)
        if op.partner is None:
            return
        a, b = (op.rank, op.group), (op.partner.rank, op.partner.group)
        if a not in started or b not in started:
            return
        send = op if op.ins.op not in RECV_OPS else op.partner
        op.done = op.partner.done = max(started[a], started[b]) + self.xfer(send.rank, send.peer, op.kind)
        self.work.append(b)  # the partner's group may now be complete

    def _complete_eagerly(self, op: _Op) -> None:
        """The ideal transport: a started send is done; its receive once both have started, `transfer` after the
        send started."""
        started = self.started
        send = op if op.ins.op not in RECV_OPS else op.partner
        recv = op if send is not op else op.partner
        if send is not None and send.done is None and (send.rank, send.group) in started:
            send.done = started[(send.rank, send.group)]
            self.work.append((send.rank, send.group))
        if None not in (send, recv) and recv.done is None and send.done is not None \
                and (recv.rank, recv.group) in started:
            landed = send.done + self.xfer(send.rank, send.peer, send.kind)
            recv.done = max(started[(recv.rank, recv.group)], landed)
            self.work.append((recv.rank, recv.group))

    def check_group(self, key: tuple[int, int]) -> None:
        if key in self.completed or key not in self.started:
            return
        end = self.started[key]
        for op in self.ops_of[key]:
            if op.done is None:
                return
            end = max(end, op.done)
        self.completed[key] = end
        for s in self.keys_of[key]:
            nxt = self.next_in.get((s, key))
            if nxt is not None:
                self.work.append(nxt)

    def drain(self) -> bool:
        moved = bool(self.work)
        while self.work:
            key = self.work.popleft()
            self.try_start(key)
            self.check_group(key)
        return moved

    def post(self, r: int, group: int) -> None:
        key = (r, group)
        self.posted[key] = self.clock[r]
        self.posted_by[r].append(key)
        for s in self.keys_of[key]:
            q = self.queue_of.setdefault(s, [])
            self.prev_in[(s, key)] = q[-1] if q else None
            if q:
                self.next_in[(s, q[-1])] = key
            q.append(key)
        self.work.append(key)

    # -- the hosts -------------------------------------------------------------------------------------------
    def advance(self, r: int, step: Step) -> bool:
        """Run rank r's `step`; False when its host must wait there."""
        clock = self.clock
        if isinstance(step, Compute):
            dt = float(self.cost(r, step.instruction))
            self.compute_spans.append((r, step.instruction, clock[r], clock[r] + dt))
            clock[r] += dt
            self.busy[r] += dt
        elif isinstance(step, Create):
            self.arrived.setdefault((step.src, step.dst, r), clock[r])
            other = step.dst if r == step.src else step.src
            if (step.src, step.dst, other) not in self.arrived:
                return self.blocked(r)
            self.waiting_since.pop(r, None)
            clock[r] = max(self.arrived[(step.src, step.dst, r)], self.arrived[(step.src, step.dst, other)])
        elif isinstance(step, Sync):
            self.drain()
            if any(key not in self.completed for key in self.posted_by[r]):
                return self.blocked(r)
            self.waiting_since.pop(r, None)
            clock[r] = max([clock[r]] + [self.completed[key] for key in self.posted_by[r]])
        elif isinstance(step, (Post, Collective)):
            self.post(r, step.group)
        else:
            key = (r, step.group)
            self.drain()
            if key not in self.completed:
                return self.blocked(r)
            start = self.waiting_since.pop(r, clock[r])
            clock[r] = max(clock[r], self.completed[key])
            self.wait_spans.append((r, step.group, start, clock[r]))
        return True

    def blocked(self, r: int) -> bool:
        self.waiting_since.setdefault(r, self.clock[r])
        return False

    def run(self) -> TransportResult:
        plans, pc = self.plans, self.pc
        progressed = True
        while progressed:
            progressed = False
            for r, plan in enumerate(plans):
                while pc[r] < len(plan) and self.advance(r, plan[pc[r]]):
                    pc[r] += 1
                    progressed = True
                if self.drain():
                    progressed = True
        stuck_at = {r: plans[r][pc[r]] for r in range(len(plans)) if pc[r] < len(plans[r])}
        stuck = {r: str(step) for r, step in stuck_at.items()}
        result = TransportResult(
            step_time=math.inf if stuck else max(self.clock, default=0.0), finish=self.clock, busy=self.busy,
            compute_spans=self.compute_spans, wait_spans=self.wait_spans, deadlock=bool(stuck), stuck=stuck,
            stuck_at=stuck_at, posted=self.posted)
        if stuck:
            result.report = _report(plans, pc, self.ops_of, self.posted, self.started, stuck)
        return result


def _created_at_first_use(plan: list[Step], rank: int) -> list[Step]:
    """`plan` with a Create before the first post on each channel that no earlier Create made."""
    made: set[tuple[int, int]] = set()
    out: list[Step] = []
    for step in plan:
        if isinstance(step, Create):
            made.add((step.src, step.dst))
        elif isinstance(step, Post):
            for ins in step.messages:
                ch = channel(ins, rank)
                if ch not in made:
                    made.add(ch)
                    out.append(Create(*ch))
        out.append(step)
    return out


def _report(plans, pc, ops_of, posted, started, stuck) -> list[str]:
    lines = []
    for r, step in stuck.items():
        line = f"rank {r} is stuck at {step}"
        s = plans[r][pc[r]]
        if isinstance(s, Wait):
            key = (r, s.group)
            if key not in started:
                line += " (its group has not started: an earlier group on its stream has not completed)"
            for op in ops_of[key]:
                if op.done is not None:
                    continue
                if op.kind == "collective":
                    absent = [q for q in op.ins.ranks if not any(
                        m.rank == q and (m.rank, m.group) in started for m in op.members or ())]
                    line += f"; {op.ins} waits for rank(s) {absent} to start it" if op.members else \
                        f"; {op.ins} is never posted by every member"
                elif op.partner is None:
                    line += f"; {op.ins} has no counterpart posted on rank {op.peer}"
                else:
                    pk = (op.partner.rank, op.partner.group)
                    state = ("not yet posted" if pk not in posted else
                             "queued behind an unfinished group" if pk not in started else "started")
                    line += f"; {op.ins} waits for {op.partner.ins} on rank {op.peer} ({state})"
        elif isinstance(s, Create):
            other = s.dst if r == s.src else s.src
            line += f" (the communicator's rendezvous: rank {other} never reaches its own CREATE of it)"
        elif isinstance(s, Sync):
            line += " (a device-wide synchronize: some posted operation never completes)"
        lines.append(line)
    return lines


def check_plans(plans: list[list[Step]], streams: str = "channel", lazy: bool = True) -> None:
    """Raise AssertionError naming the stuck ranks if the plans deadlock under NCCL's rules, the host's
    included (communicators created at first use unless the plans create them: `exchange.with_communicators`;
    MismatchError if two matched operations carry different messages)."""
    res = run_exchange(plans, streams=streams, lazy=lazy)
    if res.deadlock:
        raise AssertionError("deadlock under NCCL semantics: " + " | ".join(res.report))

