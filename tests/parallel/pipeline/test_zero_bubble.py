"""Split-backward schedules (ZB-H1, ZB-V, V-Half): F, B and W once each in causal order, free of deadlock, their
bubbles and memory."""

from __future__ import annotations

import pytest

from mlplat.parallel.layout.pipeline import PipelineLayout
from mlplat.parallel.layout.schedules import Instruction, Op, build_schedule, rank_schedule
from mlplat.perf.simulator import CostModel, check_schedule, simulate
from tests.helpers.schedules import check_message_placement

B = Op.BACKWARD
W = Op.WEIGHT


def _pending_w(ops) -> int:
    pending = peak = 0
    for i in ops:
        pending += (i.op is B) - (i.op is W)
        peak = max(peak, pending)
    return peak


@pytest.mark.parametrize("kind,v", [("zb_h1", 1), ("zb_h2", 1), ("zbv", 2), ("v_half", 2)])
def test_zero_bubble_schedules(kind, v):
    """Every (chunk, micro-batch) runs F, B and W once, in causal order, without deadlock; zb_h1's bubble is at
    most 1F1B's / 2.5 for m >= 2p, zbv's (p-1)/(6m) for m >= 2p; peak activations at most 1F1B's, pending W's
    at most p micro-batches; v_half's both at most p/2 micro-batches (at least one), its bubble 0.42-0.64 of
    1F1B's for p >= 4, m >= 2p; zb_h2 at most 2(p-r)-1 micro-batches on rank r and 2p-1 pending W's, one step's
    bubble no larger than zb_h1's."""
    for p in range(1, 9):
        for m in range(1, 4 * p + 1):
            sched = build_schedule(kind, p, v, m)
            check_schedule(sched, p, v, m, kind)  # F, B, W once each, B after F, W after B, inputs in time
            check_message_placement(sched, p, v, kind)
            one = CostModel(forward=1.0 / v, backward=1.0 / v, weight=1.0 / v, transfer=0.0)
            res = simulate(sched, one, v)
            assert not res.deadlock, (kind, p, m)
            base = simulate(build_schedule("1f1b", p, 1, m), CostModel(forward=1.0, backward=2.0), 1)
            if kind in ("zb_h1", "zb_h2") and m >= 2 * p:
                assert res.bubble_fraction <= base.bubble_fraction / 2.5 + 1e-12, (p, m)
            if kind == "zb_h2":
                assert all(res.peak_in_flight[r] <= 2 * (p - r) - 1 for r in range(p)), (p, m, res.peak_in_flight)
                assert max(_pending_w(ops) for ops in sched) <= 2 * p - 1, (p, m)
                continue
            if kind == "zbv" and m >= 2 * p:  # rank r waits r chunk forwards for its first input, then never
                assert res.bubble_fraction == pytest.approx((p - 1) / (6 * m), abs=1e-12), (p, m)
            if kind == "v_half" and p >= 4 and m >= 2 * p:
                assert 0.42 * base.bubble_fraction <= res.bubble_fraction <= 0.64 * base.bubble_fraction, (p, m)
            limit = max(p, 2) / 2 if kind == "v_half" else max(base.peak_in_flight_micro_batches)
            assert max(res.peak_in_flight_micro_batches) <= limit, (kind, p, m)
            assert max(_pending_w(ops) for ops in sched) <= (max(p, 2) if kind == "v_half" else p * v), (kind, p, m)


def test_zero_bubble_figures():
    one = lambda v: CostModel(forward=1.0 / v, backward=1.0 / v, weight=1.0 / v)  # noqa: E731
    h1 = simulate(build_schedule("zb_h1", 4, 1, 16), one(1), 1)
    assert h1.bubble_fraction == pytest.approx(3 / (3 * 16))  # (p-1)/(3m)
    zbv = simulate(build_schedule("zbv", 4, 2, 16), one(2), 2)
    assert zbv.bubble_fraction < h1.bubble_fraction
    assert PipelineLayout(4, 2, "zbv").chunks_of(1) == [1, 6]
    ops = rank_schedule("zbv", 4, 2, 16, 0)
    # Rank 0 holds the first chunk and the last (the loss): the forward of chunk 7 follows chunk 6's on rank 1.
    assert Instruction(Op.RECV_ACT, 7, 0, 1) in ops and not any(i.op is Op.SEND_ACT and i.chunk == 7 for i in ops)


def test_zb_h2_back_to_back_is_bubble_free():
    """ZB-H2 (Qi et al.'s, at about twice 1F1B's memory): back to back, at F = B = W, its steps take exactly their
    work, 3m, for every p <= 8 and m from 2p - 1 to 4p, under the ideal transport, and under the engine's exchange
    plans on NCCL's rules at p = 4 and 8 (m = 2p, 4p); alone a step has zb_h1's bubble, (p-1)/(3m), since
    rank r still waits r forwards for its first input."""
    from mlplat.perf.simulator import simulate_nccl, steady_state_step

    cost = CostModel(forward=1.0, backward=1.0, weight=1.0)
    for p in range(2, 9):
        for m in range(2 * p - 1, 4 * p + 1):
            sched = build_schedule("zb_h2", p, 1, m)
            assert steady_state_step(sched, cost, 1) == pytest.approx(3 * m, abs=1e-9), (p, m)
            h1 = simulate(build_schedule("zb_h1", p, 1, m), cost, 1).step_time
            assert simulate(sched, cost, 1).step_time == pytest.approx(h1, abs=1e-9), (p, m)
    for p in (4, 8):
        for m in (2 * p, 4 * p):
            sched = build_schedule("zb_h2", p, 1, m)
            assert steady_state_step(sched, cost, 1, simulate_nccl) == pytest.approx(3 * m, abs=1e-9), (p, m)


def test_zbv_back_to_back_is_bubble_free():
    """Steps run back to back (nothing global between them, mlplat.perf.simulator.back_to_back), at F = B = W: ZB-V
    takes exactly its work per step, 3m, for every p <= 8 and m from 2p to 4p under the ideal transport, and under
    the engine's exchange plans on NCCL's rules where p divides m and where it does not (m = 4p, 2p + 1). Rank
    r's only idle time is its wait of r chunk forwards at the start, which the previous step's tail fills. The
    other schedules' idle time sits inside each rank's order: their steps take as long back to back as alone
    (1F1B, interleaved, ZB-H1, V-Half at p = 4, m = 8)."""
    from mlplat.parallel.layout.zero_bubble import _list_schedule
    from mlplat.perf.simulator import simulate_nccl, steady_state_step

    # The plain priorities leave ranks idle inside the step where p does not divide m: 6 chunk computes at p=4, m=9.
    plain = _list_schedule(PipelineLayout(4, 2, "zbv"), 9, lambda r, c, on_rank, in_chunk: on_rank < 8, w_limit=8)
    assert plain[2] == 6
    cost = CostModel(forward=0.5, backward=0.5, weight=0.5)
    for p in range(2, 9):
        for m in range(2 * p, 4 * p + 1):
            sched = build_schedule("zbv", p, 2, m)
            transports = (simulate, simulate_nccl) if m in (2 * p + 1, 4 * p) else (simulate,)
            for transport in transports:
                assert steady_state_step(sched, cost, 2, transport) == pytest.approx(3 * m, abs=1e-9), (p, m)
            alone = simulate(sched, cost, 2).step_time
            assert alone == pytest.approx(3 * m + (p - 1) * 0.5, abs=1e-9), (p, m)  # one step: (p-1)/(6m)
    for kind, v in (("1f1b", 1), ("interleaved", 2), ("zb_h1", 1), ("v_half", 2)):
        split = kind in ("zb_h1", "v_half")
        cost = CostModel(forward=1 / v, backward=(1 if split else 2) / v, weight=1 / v)
        sched = build_schedule(kind, 4, v, 8)
        assert steady_state_step(sched, cost, v) == pytest.approx(simulate(sched, cost, v).step_time), kind
