"""mlplat.perf.simulator: deadlocks and the ranks stuck in them, transfer and per-rank costs, the structural checker
of schedules, and NCCL-rule timing equal to the ideal transport."""

from __future__ import annotations

import pytest

from mlplat.parallel.layout.schedules import Instruction, Op, build_schedule
from mlplat.perf.simulator import CostModel, check_schedule, simulate, simulate_nccl
from tests.helpers.schedules import schedule_cases

F, B = Op.FORWARD, Op.BACKWARD


def test_deadlock_reported_with_stuck_ranks():
    # Rank 0 waits for a gradient before it has sent the activation that would produce it.
    rank0 = [Instruction(Op.RECV_GRAD, 0, 0, 1), Instruction(F, 0, 0), Instruction(Op.SEND_ACT, 0, 0, 1),
             Instruction(B, 0, 0)]
    rank1 = [Instruction(Op.RECV_ACT, 1, 0, 0), Instruction(F, 1, 0), Instruction(B, 1, 0),
             Instruction(Op.SEND_GRAD, 1, 0, 0)]
    check_schedule([rank0, rank1], 2, 1, 1)  # structurally fine: only the timing proves the deadlock
    res = simulate([rank0, rank1], CostModel(), v=1)
    assert res.deadlock
    assert res.stuck == {0: rank0[0], 1: rank1[0]}
    assert res.step_time == float("inf")


def test_partial_deadlock_names_only_stuck_ranks():
    sched = build_schedule("1f1b", 3, 1, 3)
    # Drop rank 1's first SEND_ACT: rank 2 waits forever, which in turn starves rank 1 and then rank 0.
    sched[1] = [i for i in sched[1] if not (i.op is Op.SEND_ACT and i.micro_batch == 0)]
    res = simulate(sched, CostModel(), v=1)
    assert res.deadlock
    assert res.stuck[2] == Instruction(Op.RECV_ACT, 2, 0, 1)
    assert set(res.stuck) == {0, 1, 2}


def test_transfer_and_callable_costs():
    # p=2, m=1: F0 -> act transfer -> F1 -> B1 -> grad transfer -> B0.
    sched = build_schedule("1f1b", 2, 1, 1)
    res = simulate(sched, CostModel(forward=1.0, backward=2.0, transfer=0.5), v=1)
    assert res.step_time == pytest.approx(1 + 0.5 + 1 + 2 + 0.5 + 2)
    # A slow last stage sets the pace: ideal is the busiest rank's compute.
    cost = CostModel(forward=lambda r, c, mb: 2.0 if r == 1 else 1.0, backward=lambda r, c, mb: 2.0)
    res = simulate(build_schedule("gpipe", 2, 1, 4), cost, v=1)
    assert not res.deadlock
    ideal = 4 * (2.0 + 2.0)
    assert res.bubble_fraction == pytest.approx((res.step_time - ideal) / ideal)
    # Waits for messages show up as RECV events; F/B events cover exactly the compute.
    waits = [e for e in res.events if e.op is Op.RECV_ACT]
    assert all(e.end >= e.start for e in waits)
    assert len(res.compute_events()) == 2 * 2 * 4


@pytest.mark.parametrize("mutate,fragment", [
    (lambda s: s[0].pop(s[0].index(Instruction(B, 0, 1))), "B(c0,mb1) missing"),
    (lambda s: s[1].remove(Instruction(Op.SEND_GRAD, 1, 0, 0)), "no SEND_GRAD after it"),
    (lambda s: s[0].append(Instruction(Op.SEND_ACT, 0, 0, 1)), "duplicate"),
    (lambda s: s[1].insert(0, s[1].pop(s[1].index(Instruction(B, 1, 0)))), "comes before its F"),
    (lambda s: s[0].__setitem__(s[0].index(Instruction(Op.SEND_ACT, 0, 1, 1)),
                                Instruction(Op.SEND_ACT, 0, 1, 0)), "names peer 0"),
    (lambda s: s[1].append(Instruction(F, 0, 0)), "lives on rank 0"),
])
def test_check_schedule_rejects(mutate, fragment):
    sched = build_schedule("1f1b", 2, 1, 2)
    mutate(sched)
    with pytest.raises(AssertionError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        check_schedule(sched, 2, 1, 2)


def test_check_schedule_rejects_recv_after_compute():
    sched = build_schedule("1f1b", 2, 1, 1)
    prog = sched[1]
    recv = prog.pop(prog.index(Instruction(Op.RECV_ACT, 1, 0, 0)))
    prog.insert(prog.index(Instruction(F, 1, 0)) + 1, recv)
    with pytest.raises(AssertionError, match="comes after F"):
        check_schedule(sched, 2, 1, 1)


def test_nccl_timing_equals_the_ideal_transport_with_free_transfers():
    # Nothing waits on a send before the step ends, so the transport adds no wait the schedule does not have.
    for kind, p, v, m in schedule_cases():
        sched = build_schedule(kind, p, v, m)
        cost = CostModel(forward=1.0, backward=2.0, weight=1.0, transfer=0.0)
        ideal, nccl = simulate(sched, cost, v).step_time, simulate_nccl(sched, cost, v).step_time
        assert nccl == pytest.approx(ideal, abs=1e-9), (kind, p, v, m)
