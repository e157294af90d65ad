"""Timing pipeline schedules, and a structural checker for them.

Two transports, one event loop (the transport model's, `mlplat.perf.transport.run_exchange`). `simulate` is the
ideal one (sends never block: a message lands `transfer` seconds after its SEND, a RECV waits for it), which gives
the paper's bubble formulas exactly. `simulate_nccl` times what the engine really posts - the exchange plans of
`mlplat.parallel.layout.exchange` under NCCL's rules: a transfer starts only when both its send and its receive are
posted, and a channel runs its operations in order. The planner, the cluster cost model and the timeline use
`simulate_nccl`; with free transfers the two agree exactly (tests/perf/test_simulator.py).

Both execute the very instruction lists the engine runs (`mlplat.parallel.layout.schedules`) with the same
semantics: each rank runs its list in order, F/B/W take their cost, messages are posted and waited for. When no
rank can move while some are unfinished the schedule deadlocks, and the result says where, instead of hanging.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Callable, Union

from mlplat.parallel.layout.pipeline import PipelineLayout
from mlplat.parallel.layout.schedules import COMPUTE_OPS, Instruction, Op

Cost = Union[float, Callable[..., float]]


@dataclass
class CostModel:
    forward: Cost = 1.0  # (rank, chunk, micro_batch) -> seconds, per chunk
    backward: Cost = 2.0  # (rank, chunk, micro_batch) -> seconds, per chunk; B alone in zero-bubble schedules
    transfer: Cost = 0.0  # (src_rank, dst_rank, "act" | "grad") -> seconds
    weight: Cost = 1.0  # W (zero-bubble schedules): the weight-gradient half of a backward, per chunk
    # (rank, chunk, micro_batch) -> seconds: what a pair (1f1b_overlap) hides, its expert all-to-alls run behind the
    # other pass's compute, taken off its paired B (the pair costs F + B - hidden)
    hidden: Cost = 0.0

    def compute(self, rank: int, ins: Instruction) -> float:
        fn = {Op.FORWARD: self.forward, Op.BACKWARD: self.backward, Op.WEIGHT: self.weight}[ins.op]
        time = fn(rank, ins.chunk, ins.micro_batch) if callable(fn) else float(fn)
        if ins.paired:
            hidden = self.hidden
            time -= hidden(rank, ins.chunk, ins.micro_batch) if callable(hidden) else float(hidden)
        return max(time, 0.0)

    def transfer_time(self, src: int, dst: int, kind: str) -> float:
        return self.transfer(src, dst, kind) if callable(self.transfer) else float(self.transfer)


@dataclass
class Event:
    rank: int
    op: Op
    chunk: int
    micro_batch: int
    start: float  # for a RECV: when the rank began waiting; end: when the data was there
    end: float


@dataclass
class SimResult:
    step_time: float  # inf on deadlock
    bubble_fraction: float  # (step_time - ideal) / ideal, ideal = busiest rank's pure compute time
    events: list[Event]
    peak_in_flight: list[int]  # per rank, chunk activations held (forwards done, backward not yet)
    peak_in_flight_micro_batches: list[float]  # = peak_in_flight / v
    deadlock: bool = False
    stuck: dict = field(default_factory=dict)  # rank -> the instruction (or exchange step) it is blocked on
    finish: list[float] = field(default_factory=list)  # per rank: when its last instruction ended
    report: list[str] = field(default_factory=list)  # simulate_nccl: what each stuck rank waits for

    def compute_events(self) -> list[Event]:
        return [e for e in self.events if e.op in COMPUTE_OPS]



def _activation_change(op: Op) -> int:
    """F stores a chunk activation, B frees it, also when the backward is split: W keeps only the inputs of the
    weight GEMMs and their output gradients, which `mlplat.perf.memory` counts apart."""
    return {Op.FORWARD: 1, Op.BACKWARD: -1}.get(op, 0)


def simulate(schedule: list[list[Instruction]], cost: CostModel | None = None, v: int = 1) -> SimResult:
    """Time `schedule` (one instruction list per pipeline rank) under `cost`, with the ideal transport: a SEND
    costs its rank nothing and its message lands `transfer` seconds later, a RECV waits until it has landed. Run by
    the transport model's event loop (`mlplat.perf.transport`, streams="ideal") on the instruction lists as plans
    of one message a post, a receive waited for at once."""
    from mlplat.parallel.layout.exchange import RECV_OPS, Compute, Post, Wait
    from mlplat.perf.transport import prepare, run_exchange

    cost = cost or CostModel()
    plans = []
    for prog in schedule:
        plan, group = [], 0
        for ins in prog:
            if ins.op in COMPUTE_OPS:
                plan.append(Compute(ins))
                continue
            plan.append(Post(group, (ins,)))
            if ins.op in RECV_OPS:
                plan.append(Wait(group))
            group += 1
        plans.append(plan)
    res = run_exchange(prepare(plans, streams="ideal"), compute=cost.compute, transfer=cost.transfer_time)
    messages = {(r, step.group): step.messages[0] for r, plan in enumerate(plans) for step in plan
                if isinstance(step, Post)}
    waits = {(r, group): (start, end) for r, group, start, end in res.wait_spans}
    events = [Event(r, ins.op, ins.chunk, ins.micro_batch, s, e) for r, ins, s, e in res.compute_spans]
    for (r, group), ins in messages.items():
        at = res.posted.get((r, group))
        if at is not None:
            start, end = waits.get((r, group), (at, at)) if ins.op in RECV_OPS else (at, at)
            events.append(Event(r, ins.op, ins.chunk, ins.micro_batch, start, end))
    events.sort(key=lambda e: (e.rank, e.start, e.end))
    stuck = {r: (step.instruction if isinstance(step, Compute) else messages[(r, step.group)])
             for r, step in res.stuck_at.items()}
    return _result(res.step_time, res.busy, res.finish, events, v, stuck, res.deadlock)


def simulate_nccl(schedule: list[list[Instruction]], cost: CostModel | None = None, v: int = 1,
                  lookahead: int = 1, plans: list | None = None) -> SimResult:
    """Time `schedule` as the engine executes it on NCCL: through its exchange plans (`exchange_plans`; pass
    `plans`, computed once - or `transport.prepare`d - when the same schedule is timed under many cost models)."""
    from mlplat.parallel.layout.exchange import exchange_plans
    from mlplat.perf.transport import run_exchange

    cost = cost or CostModel()
    plans = exchange_plans(schedule, lookahead) if plans is None else plans
    res = run_exchange(plans, compute=cost.compute, transfer=cost.transfer_time)
    events = [Event(r, ins.op, ins.chunk, ins.micro_batch, s, e) for r, ins, s, e in res.compute_spans]
    return _result(res.step_time, res.busy, res.finish, events, v, dict(res.stuck), res.deadlock, res.report)


def _result(step_time: float, busy: list[float], finish: list[float], events: list[Event], v: int, stuck: dict,
            deadlock: bool, report: list[str] | None = None) -> SimResult:
    """A run of the event loop as the schedule's timing: the bubble against the busiest rank's compute, and each
    rank's peak of chunk activations held."""
    p = len(busy)
    in_flight, peak = [0] * p, [0] * p
    for e in sorted(events, key=lambda e: (e.rank, e.start, e.end)):
        in_flight[e.rank] += _activation_change(e.op)
        peak[e.rank] = max(peak[e.rank], in_flight[e.rank])
    ideal = max(busy, default=0.0)
    bubble = math.inf if deadlock else ((step_time - ideal) / ideal if ideal > 0 else 0.0)
    return SimResult(step_time=step_time, bubble_fraction=bubble, events=events, peak_in_flight=peak,
                     peak_in_flight_micro_batches=[x / v for x in peak], deadlock=deadlock, stuck=stuck,
                     finish=list(finish), report=report or [])


def back_to_back(schedule: list[list[Instruction]], steps: int) -> list[list[Instruction]]:
    """`steps` copies of each rank's list one after the other, the micro-batches of copy k renumbered by k·m: the
    steps of a run with nothing global between them (no all-reduce a rank must wait in before its next step)."""
    m = 1 + max(ins.micro_batch for rank in schedule for ins in rank)
    return [[replace(ins, micro_batch=ins.micro_batch + k * m) for k in range(steps) for ins in rank]
            for rank in schedule]


STEADY_STEPS = 3  # steps run back to back to time one in the steady state: the last, after two that fill its ends


def steady_state_step(schedule: list[list[Instruction]], cost: CostModel | None = None, v: int = 1,
                      transport: Callable[..., SimResult] = simulate) -> float:
    """The time per step once steps run back to back (`back_to_back`): what the last of STEADY_STEPS steps adds to
    the ones before it. A step's own bubble stays unless its ranks' idle time sits at its start and end, where the next
    step's work and the previous step's tail can fill it (ZB-V's, for m >= 2p)."""
    before, last = (transport(back_to_back(schedule, k), cost, v).step_time for k in (STEADY_STEPS - 1, STEADY_STEPS))
    return last - before


def check_schedule(schedule: list[list[Instruction]], p: int, v: int, m: int, kind: str = "interleaved") -> None:
    """Structural check of a schedule; raises AssertionError naming the first broken rule.

    Rules: every (chunk, micro-batch) has exactly one F and one B, on the rank that owns the chunk, B after
    F, and when the schedule splits the backward (its registry entry) exactly one W, after its B, else none; a
    compute's input (activation from chunk c-1, gradient from chunk c+1) is there before it runs: computed
    earlier on the same rank, or received by a RECV placed earlier on this rank whose matching SEND (naming
    this rank) follows the producing compute on the neighbour; no message is stray, duplicated or between
    chunks of the same rank. Deadlock freedom is `simulate`'s business.
    """
    layout = PipelineLayout(p, v, kind)
    n, split = layout.num_chunks, layout.spec.split_backward
    assert len(schedule) == p, f"schedule has {len(schedule)} rank lists, expected parallel.pp={p}"
    at: dict[tuple[Op, int, int], tuple[int, int, Instruction]] = {}  # (op, chunk, mb) -> (rank, index, ins)
    for r, prog in enumerate(schedule):
        for i, ins in enumerate(prog):
            where = f"rank {r} #{i} {ins}"
            assert 0 <= ins.chunk < n, f"{where}: chunk outside [0, {n})"
            assert 0 <= ins.micro_batch < m, f"{where}: micro-batch outside [0, {m})"
            owner = layout.owner(ins.chunk)
            assert owner == r, f"{where}: chunk {ins.chunk} lives on rank {owner}"
            assert split or ins.op is not Op.WEIGHT, f"{where}: a W, but {kind} does not split the backward"
            key = (ins.op, ins.chunk, ins.micro_batch)
            assert key not in at, f"{where}: duplicate of rank {at[key][0]} #{at[key][1]}"
            at[key] = (r, i, ins)

    used = set()  # message instructions accounted for by some compute's input
    for c in range(n):
        for mb in range(m):
            f, b = at.get((Op.FORWARD, c, mb)), at.get((Op.BACKWARD, c, mb))
            assert f is not None, f"F(c{c},mb{mb}) missing"
            assert b is not None, f"B(c{c},mb{mb}) missing"
            assert f[1] < b[1], f"rank {f[0]}: B(c{c},mb{mb}) at #{b[1]} comes before its F at #{f[1]}"
            if split:
                w = at.get((Op.WEIGHT, c, mb))
                assert w is not None, f"W(c{c},mb{mb}) missing"
                assert b[1] < w[1], f"rank {b[0]}: W(c{c},mb{mb}) at #{w[1]} comes before its B at #{b[1]}"
            if c > 0:
                used |= _check_input(at, (Op.FORWARD, c, mb), (Op.FORWARD, c - 1, mb), Op.SEND_ACT, Op.RECV_ACT)
            if c < n - 1:
                used |= _check_input(at, (Op.BACKWARD, c, mb), (Op.BACKWARD, c + 1, mb), Op.SEND_GRAD, Op.RECV_GRAD)
    for key, (r, i, ins) in at.items():
        if ins.op not in COMPUTE_OPS:
            assert key in used, f"rank {r} #{i} {ins}: no compute needs this message (stray or local)"


def _check_input(at, consumer, producer, send_op, recv_op) -> set:
    """Assert the consumer's input flows from the producer; return the message keys that carry it."""
    rank, ci, cins = at[consumer]
    prank, pi, pins = at[producer]
    if prank == rank:
        assert pi < ci, f"rank {rank}: {cins} at #{ci} runs before {pins} at #{pi} that produces its input"
        return set()
    rkey, skey = (recv_op, cins.chunk, cins.micro_batch), (send_op, pins.chunk, pins.micro_batch)
    assert rkey in at, f"rank {rank}: {cins} has no {recv_op.value} before it for its input from rank {prank}"
    assert skey in at, f"rank {prank}: {pins} has no {send_op.value} after it to rank {rank}"
    _, ri, rins = at[rkey]
    _, si, sins = at[skey]
    assert ri < ci, f"rank {rank}: {rins} at #{ri} comes after {cins} at #{ci} that needs it"
    assert si > pi, f"rank {prank}: {sins} at #{si} comes before {pins} at #{pi} that produces it"
    assert rins.peer == prank, f"rank {rank}: {rins} names peer {rins.peer} but the sender is rank {prank}"
    assert sins.peer == rank, f"rank {prank}: {sins} names peer {sins.peer} but the receiver is rank {rank}"
    return {rkey, skey}
