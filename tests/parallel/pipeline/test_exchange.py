"""The engine's posting order under NCCL's point-to-point rules (mlplat.perf.transport).

The checker runs `exchange_plans` - the very steps the engine executes - for every schedule, p <= 8, v <= 4 and
every valid m up to 4p, training and forward-only, on one communicator per direction (the engine's channels).
It is shown to fail on the posting orders that do hang on NCCL: the previous engine's on one communicator for
all pipeline traffic (receives posted one compute ahead, or at their RECV), the same plans without directed
channels, and a plan whose matched operations carry different messages.
"""
from __future__ import annotations

import pytest

from mlplat.parallel.pipeline.exchange import Compute, Post, Wait, exchange_plans
from mlplat.parallel.pipeline.schedules import SCHEDULES, Instruction, Op, build_schedule
from mlplat.perf.simulator import CostModel, simulate, simulate_nccl
from mlplat.perf.transport import MismatchError, check_plans, run_exchange

COMPUTE = (Op.FORWARD, Op.BACKWARD, Op.WEIGHT)
FORWARD_ONLY = (Op.FORWARD, Op.SEND_ACT, Op.RECV_ACT)


def _cases():
    for kind in SCHEDULES:
        for p in range(1, 9):
            for v in {"interleaved": [1, 2, 3, 4], "zbv": [2]}.get(kind, [1]):
                if v > 1 and p == 1:
                    continue
                for m in range(1, 4 * p + 1):
                    if kind == "interleaved" and m % p:
                        continue
                    yield kind, p, v, m


def _plans(kind, p, v, m, forward_only=False):
    sched = build_schedule(kind, p, v, m)
    if forward_only:
        sched = [[i for i in ops if i.op in FORWARD_ONLY] for ops in sched]
    return exchange_plans(sched)


@pytest.mark.parametrize("kind", SCHEDULES)
def test_every_schedule_is_free_of_deadlock_under_nccl_rules(kind):
    n = 0
    for case in _cases():
        if case[0] != kind:
            continue
        for forward_only in (False, True):
            check_plans(_plans(*case, forward_only))
            n += 1
    assert n > 50


def test_plan_posts_every_message_once_and_waits_before_use():
    for kind, p, v, m in [("1f1b", 4, 1, 8), ("interleaved", 4, 2, 8), ("interleaved", 2, 4, 6), ("gpipe", 3, 1, 5),
                          ("zbv", 3, 2, 6), ("zb_h1", 4, 1, 8)]:
        for ops, plan in zip(build_schedule(kind, p, v, m), _plans(kind, p, v, m)):
            messages = [x for s in plan if isinstance(s, Post) for x in s.messages]
            assert sorted(map(str, messages)) == sorted(str(i) for i in ops if i.op not in COMPUTE)
            assert [s.instruction for s in plan if isinstance(s, Compute)] == [i for i in ops if i.op in COMPUTE]
            posted_at, waited_at = {}, {}
            for k, s in enumerate(plan):
                if isinstance(s, Post):
                    posted_at.update({x: (k, s.group) for x in s.messages})
                elif isinstance(s, Wait):
                    waited_at[s.group] = k
            assert sorted(waited_at) == list(range(len(waited_at)))  # every group is waited for, once
            computed_at = {(s.instruction.op, s.instruction.chunk, s.instruction.micro_batch): k
                           for k, s in enumerate(plan) if isinstance(s, Compute)}
            last_compute = max(k for k, s in enumerate(plan) if isinstance(s, Compute))
            for ins, (k, group) in posted_at.items():
                if ins.op in (Op.SEND_ACT, Op.SEND_GRAD):  # a send is waited for only once the step's work is done
                    assert waited_at[group] > last_compute, (kind, ins)
                if ins.op is Op.RECV_ACT:
                    assert waited_at[group] < computed_at[(Op.FORWARD, ins.chunk, ins.micro_batch)]
                elif ins.op is Op.RECV_GRAD:
                    assert waited_at[group] < computed_at[(Op.BACKWARD, ins.chunk, ins.micro_batch)]
                elif ins.op is Op.SEND_ACT:
                    assert k > computed_at[(Op.FORWARD, ins.chunk, ins.micro_batch)]
                else:
                    assert k > computed_at[(Op.BACKWARD, ins.chunk, ins.micro_batch)]


def _one_message_per_group(ops, lookahead):
    """The previous engine's posting: every SEND/RECV on its own, receives posted `lookahead` computes early."""
    computes = [k for k, i in enumerate(ops) if i.op in COMPUTE]
    post_before: dict[int, list[int]] = {}
    for k, i in enumerate(ops):
        if i.op in (Op.RECV_ACT, Op.RECV_GRAD):
            nxt = next(c for c in computes if c > k)
            target = computes[max(0, computes.index(nxt) - lookahead)]
            post_before.setdefault(target if target < k else k, []).append(k)
    steps, group_of = [], {}
    for k, i in enumerate(ops):
        for j in post_before.get(k, []):
            group_of[j] = len(group_of)
            steps.append(Post(group_of[j], (ops[j],)))
        if i.op in COMPUTE:
            steps.append(Compute(i))
        elif i.op in (Op.SEND_ACT, Op.SEND_GRAD):
            group_of[k] = len(group_of)
            steps.append(Post(group_of[k], (i,)))
        else:
            steps.append(Wait(group_of[k]))
    sends = [g for k, g in group_of.items() if ops[k].op in (Op.SEND_ACT, Op.SEND_GRAD)]
    return steps + [Wait(g) for g in sends]


def test_checker_reports_the_deadlock_of_the_previous_posting_order():
    # 1F1B, p=2, m=2, receives posted one compute ahead: rank 0 posts S(A0) R(G0) S(A1) R(G1), rank 1
    # R(A0) R(A1) S(G0) S(G1); rank 0 waits on G0, queued on rank 1 behind R(A1), which waits for rank 0's S(A1),
    # queued behind R(G0). The report names both ranks and what each operation waits for.
    plans = [_one_message_per_group(ops, 1) for ops in build_schedule("1f1b", 2, 1, 2)]
    assert [str(s.messages[0]) for s in plans[0] if isinstance(s, Post)] == [
        "SEND_ACT(c0,mb0<->1)", "RECV_GRAD(c0,mb0<->1)", "SEND_ACT(c0,mb1<->1)", "RECV_GRAD(c0,mb1<->1)"]
    res = run_exchange(plans, streams="pair")
    assert res.deadlock and set(res.stuck) == {0, 1}
    text = " | ".join(res.report)
    assert "rank 0 is stuck" in text and "rank 1 is stuck" in text
    assert "RECV_GRAD(c0,mb0<->1) waits for SEND_GRAD(c1,mb0<->0) on rank 1" in text
    with pytest.raises(AssertionError, match="deadlock under NCCL semantics"):
        check_plans(plans, streams="pair")
    # Posted at their RECV instead, the two ranks' sends cross: also a deadlock once sends block.
    assert run_exchange([_one_message_per_group(ops, 0) for ops in build_schedule("1f1b", 2, 1, 2)],
                        streams="pair").deadlock


@pytest.mark.parametrize("kind,p,v,m", [("1f1b", 2, 1, 2), ("interleaved", 2, 2, 4), ("zbv", 4, 2, 8)])
def test_the_same_plans_deadlock_without_directed_channels(kind, p, v, m):
    # Why each direction has a communicator of its own: on one shared communicator per pair, a send that waits
    # for its receive holds up the receives queued behind it.
    plans = exchange_plans(build_schedule(kind, p, v, m))
    assert not run_exchange(plans, streams="channel").deadlock
    assert run_exchange(plans, streams="pair").deadlock


def test_checker_refuses_crossed_messages():
    # Two sends to the same peer posted in the opposite order to the receives: with tags gloo would sort this
    # out; NCCL delivers each into the wrong buffer.
    a0, a1 = Instruction(Op.SEND_ACT, 0, 0, 1), Instruction(Op.SEND_ACT, 0, 1, 1)
    r0, r1 = Instruction(Op.RECV_ACT, 1, 0, 0), Instruction(Op.RECV_ACT, 1, 1, 0)
    sender = [Post(0, (a1, a0)), Wait(0)]
    receiver = [Post(0, (r0, r1)), Wait(0)]
    with pytest.raises(MismatchError, match="without tags"):
        run_exchange([sender, receiver])
    assert not run_exchange([[Post(0, (a0, a1)), Wait(0)], receiver]).deadlock


def test_nccl_timing_equals_the_ideal_transport_with_free_transfers():
    # Nothing waits on a send before the step ends, so the transport adds no wait the schedule does not have.
    for kind, p, v, m in _cases():
        sched = build_schedule(kind, p, v, m)
        cost = CostModel(forward=1.0, backward=2.0, weight=1.0, transfer=0.0)
        ideal, nccl = simulate(sched, cost, v).step_time, simulate_nccl(sched, cost, v).step_time
        assert nccl == pytest.approx(ideal, abs=1e-9), (kind, p, v, m)
