"""The engine's exchange plans (mlplat.parallel.pipeline.exchange) under NCCL's point-to-point rules.

The checker (mlplat.perf.transport) runs `exchange_plans` - the very steps the engine executes - for every
schedule, p <= 8, v <= 4 and every valid m up to 4p, training and forward-only, on one communicator per direction
(the engine's channels); every message is posted once, after the compute that produces it, and waited for before
the compute that needs it. That the checker does fail on orders that hang on NCCL is tests/perf/test_transport.py.
"""
from __future__ import annotations

import pytest

from mlplat.parallel.pipeline.exchange import Compute, Post, Wait, exchange_plans
from mlplat.parallel.pipeline.schedules import SCHEDULES, Op, build_schedule
from mlplat.perf.transport import check_plans
from tests.helpers.schedules import schedule_cases

COMPUTE = (Op.FORWARD, Op.BACKWARD, Op.WEIGHT)
FORWARD_ONLY = (Op.FORWARD, Op.SEND_ACT, Op.RECV_ACT)


def _plans(kind, p, v, m, forward_only=False):
    sched = build_schedule(kind, p, v, m)
    if forward_only:
        sched = [[i for i in ops if i.op in FORWARD_ONLY] for ops in sched]
    return exchange_plans(sched)


@pytest.mark.parametrize("kind", SCHEDULES)
def test_every_schedule_is_free_of_deadlock_under_nccl_rules(kind):
    n = 0
    for case in schedule_cases():
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
