"""The engine's exchange plans (mlplat.parallel.layout.exchange) under NCCL's point-to-point rules.

The checker (mlplat.perf.transport) runs `exchange_plans` - the very steps the engine executes - for every
schedule, p <= 8, v <= 4 and every valid m from 1 up to 4p, training and forward-only, on one communicator per
direction (the engine's channels), each created before the step as the grid creates it (`with_communicators`),
with the host's rules on; every message is posted once, after the compute that produces it, and waited for
before the compute that needs it; a channel holds at most SEND_WINDOW sends in flight, so the buffers a rank
holds do not grow with m. That the checker does fail on orders that hang on NCCL (lazily created communicators
at m = 1 among them) is tests/perf/test_transport.py.
"""
from __future__ import annotations

import pytest

from mlplat.parallel.layout.exchange import (
    SEND_WINDOW,
    Compute,
    Post,
    Wait,
    channel,
    exchange_plans,
    live_buffers,
    with_communicators,
)
from mlplat.parallel.layout.registry import names
from mlplat.parallel.layout.schedules import Op, build_schedule
from mlplat.perf.transport import check_plans, run_exchange
from tests.helpers.schedules import schedule_cases

COMPUTE = (Op.FORWARD, Op.BACKWARD, Op.WEIGHT)
FORWARD_ONLY = (Op.FORWARD, Op.SEND_ACT, Op.RECV_ACT)


def _plans(kind, p, v, m, forward_only=False):
    sched = build_schedule(kind, p, v, m)
    if forward_only:
        sched = [[i for i in ops if i.op in FORWARD_ONLY] for ops in sched]
    return exchange_plans(sched)


def _live_sends(plan) -> int:
    live, peak = set(), 0
    for s in plan:
        if isinstance(s, Post) and s.messages[0].op in (Op.SEND_ACT, Op.SEND_GRAD):
            live.add(s.group)
            peak = max(peak, len(live))
        elif isinstance(s, Wait):
            live.discard(s.group)
    return peak


@pytest.mark.parametrize("kind", names())
def test_every_schedule_is_free_of_deadlock_under_nccl_rules(kind):
    n = 0
    for case in schedule_cases():
        if case[0] != kind:
            continue
        for forward_only in (False, True):
            plans = _plans(*case, forward_only)
            check_plans(with_communicators(plans))
            # Bounded whatever m: at most SEND_WINDOW sends per channel (a rank sends on 2 channels at most), and
            # the receives posted ahead (3 at most: zbv's early receives of a channel's earlier messages).
            assert max(map(_live_sends, plans)) <= 2 * SEND_WINDOW, case
            assert max(map(live_buffers, plans)) <= 2 * SEND_WINDOW + 3, case
            n += 1
    assert n > 50


def test_waiting_for_older_sends_costs_no_time():
    """With unit computes (and with B = 2F and slow transfers) the bounded plans take exactly as long as
    plans that wait for their sends only at the end of the step."""
    cost = {Op.FORWARD: 1.0, Op.BACKWARD: 2.0, Op.WEIGHT: 1.0}
    for kind, p, v, m in [("1f1b", 4, 1, 16), ("interleaved", 4, 2, 16), ("zbv", 4, 2, 16), ("zb_h1", 3, 1, 12),
                          ("gpipe", 3, 1, 9), ("interleaved", 2, 4, 8)]:
        sched = build_schedule(kind, p, v, m)
        for transfer in (0.0, 0.3):
            bounded = run_exchange(exchange_plans(sched), compute=lambda r, i: cost[i.op], transfer=transfer)
            unbounded = run_exchange(exchange_plans(sched, send_window=None), compute=lambda r, i: cost[i.op],
                                     transfer=transfer)
            assert bounded.step_time == unbounded.step_time, (kind, p, v, m, transfer)
        assert max(map(live_buffers, exchange_plans(sched, send_window=None))) >= m  # what the window removes


def test_plan_posts_every_message_once_and_waits_before_use():
    for kind, p, v, m in [("1f1b", 4, 1, 8), ("interleaved", 4, 2, 8), ("interleaved", 2, 4, 6), ("gpipe", 3, 1, 5),
                          ("zbv", 3, 2, 6), ("zb_h1", 4, 1, 8)]:
        for rank, (ops, plan) in enumerate(zip(build_schedule(kind, p, v, m), _plans(kind, p, v, m))):
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
            sends_on: dict = {}  # channel -> (post position, group) of its sends, in posting order
            for ins, (k, group) in sorted(posted_at.items(), key=lambda item: item[1]):
                if ins.op in (Op.SEND_ACT, Op.SEND_GRAD):
                    sends_on.setdefault(channel(ins, rank), []).append((k, group))
            for sends in sends_on.values():  # a send is waited for right before its channel's SEND_WINDOW-th
                for i, (k, group) in enumerate(sends):  # next send is posted, or once the step's work is done
                    later = sends[i + SEND_WINDOW][0] if i + SEND_WINDOW < len(sends) else None
                    if later is None:
                        assert waited_at[group] > last_compute, (kind, rank, i)
                    else:
                        assert waited_at[group] == later - 1, (kind, rank, i)
            for ins, (k, group) in posted_at.items():
                if ins.op is Op.RECV_ACT:
                    assert waited_at[group] < computed_at[(Op.FORWARD, ins.chunk, ins.micro_batch)]
                elif ins.op is Op.RECV_GRAD:
                    assert waited_at[group] < computed_at[(Op.BACKWARD, ins.chunk, ins.micro_batch)]
                elif ins.op is Op.SEND_ACT:
                    assert k > computed_at[(Op.FORWARD, ins.chunk, ins.micro_batch)]
                else:
                    assert k > computed_at[(Op.BACKWARD, ins.chunk, ins.micro_batch)]
