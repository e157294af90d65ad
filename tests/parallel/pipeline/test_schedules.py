"""Pipeline schedules: structure, deadlock freedom, the paper's bubble fractions, peak activations."""

from __future__ import annotations

import pytest

from mlplat.parallel.pipeline.layout import PipelineLayout
from mlplat.parallel.pipeline.schedules import (
    SCHEDULES,
    Instruction,
    Op,
    build_schedule,
    rank_schedule,
    validate_schedule_args,
    warmup_forwards,
)
from mlplat.perf.simulator import CostModel, check_schedule, simulate

F, B = Op.FORWARD, Op.BACKWARD
# (forward, backward) per chunk; the bubble is exact for every ratio, so try several, b = 0 included.
COST_RATIOS = [(1.0, 2.0), (1.0, 1.0), (1.0, 3.0), (2.0, 1.0), (1.0, 0.0)]


def valid_ms(kind: str, p: int) -> list[int]:
    return list(range(p, 4 * p + 1, p)) if kind == "interleaved" else list(range(1, 3 * p + 1))


CLASSIC = ("gpipe", "1f1b", "interleaved")


def sweep_cases():
    for kind in CLASSIC:
        for p in range(1, 9):
            for v in range(1, 5) if kind == "interleaved" else [1]:
                if v > 1 and p == 1:
                    continue
                yield pytest.param(kind, p, v, id=f"{kind}-p{p}-v{v}")


def expected_peak(kind: str, p: int, v: int, m: int, r: int) -> int:
    """Peak chunk activations on rank r (the formula documented in schedules.py)."""
    if kind == "gpipe":
        return m
    if kind == "1f1b" or v == 1:
        return min(p - r, m)
    return min(2 * (p - r - 1) + (v - 1) * p + 1, m * v)


@pytest.mark.parametrize("kind,p,v", sweep_cases())
def test_sweep_valid_deadlock_free_exact_bubble_and_peak(kind, p, v):
    for m in valid_ms(kind, p):
        sched = build_schedule(kind, p, v, m)
        check_schedule(sched, p, v, m)
        _check_message_placement(sched, p, v)
        paper_bubble = (p - 1) / (m * (v if kind == "interleaved" else 1))
        for f, b in COST_RATIOS:
            res = simulate(sched, CostModel(forward=f, backward=b, transfer=0.0), v)
            assert not res.deadlock, (kind, p, v, m, res.stuck)
            assert abs(res.bubble_fraction - paper_bubble) < 1e-9, (kind, p, v, m, f, b, res.bubble_fraction)
            assert abs(res.step_time - m * v * (f + b) * (1 + paper_bubble)) < 1e-9
        assert res.peak_in_flight == [expected_peak(kind, p, v, m, r) for r in range(p)], (kind, p, v, m)
        assert res.peak_in_flight_micro_batches == [x / v for x in res.peak_in_flight]
        for r in range(p):
            if kind == "1f1b":
                assert res.peak_in_flight[r] <= p - r
            # Warm-up forwards, then the steady state's first F, then the first B.
            ops = [i.op for i in sched[r] if i.op in (F, B)]
            assert ops.index(B) == min(warmup_forwards(kind, p, v, m, r) + 1, m * v)

def _check_message_placement(sched, p, v, kind="interleaved"):
    """RECV right before the compute that needs it, SEND right after the compute that produced it."""
    owner = PipelineLayout(p, v, kind).owner
    for r, prog in enumerate(sched):
        for i, ins in enumerate(prog):
            if ins.op in (Op.RECV_ACT, Op.RECV_GRAD):
                nxt = prog[i + 1]
                assert (nxt.op, nxt.chunk, nxt.micro_batch) == (
                    F if ins.op is Op.RECV_ACT else B, ins.chunk, ins.micro_batch)
                step = -1 if ins.op is Op.RECV_ACT else +1
                assert ins.peer == owner(ins.chunk + step)
            elif ins.op in (Op.SEND_ACT, Op.SEND_GRAD):
                prev = prog[i - 1]
                assert (prev.op, prev.chunk, prev.micro_batch) == (
                    F if ins.op is Op.SEND_ACT else B, ins.chunk, ins.micro_batch)
                step = +1 if ins.op is Op.SEND_ACT else -1
                assert ins.peer == owner(ins.chunk + step)


def test_api_basics():
    assert SCHEDULES == ("gpipe", "1f1b", "interleaved", "zb_h1", "zbv")
    assert PipelineLayout(4, 3, "interleaved").chunks_of(1) == [1, 5, 9]
    assert Op.FORWARD == "F" and Op.BACKWARD == "B"
    sched = build_schedule("interleaved", 4, 2, 8)
    assert [rank_schedule("interleaved", 4, 2, 8, r) for r in range(4)] == sched
    # Every instruction of a rank touches only its own chunks.
    for r, prog in enumerate(sched):
        assert {i.chunk for i in prog} == set(PipelineLayout(4, 2, "interleaved").chunks_of(r))


def test_single_rank_has_no_messages():
    for kind in ("gpipe", "1f1b", "interleaved"):
        prog = rank_schedule(kind, 1, 1, 3, 0)
        assert all(i.op in (F, B) and i.peer is None for i in prog)
    assert [(i.op, i.micro_batch) for i in rank_schedule("1f1b", 1, 1, 3, 0)] == [
        (F, 0), (B, 0), (F, 1), (B, 1), (F, 2), (B, 2)]


def test_interleaved_v1_is_1f1b():
    for p in (1, 2, 4):
        for m in (p, 2 * p, 3 * p):
            assert build_schedule("interleaved", p, 1, m) == build_schedule("1f1b", p, 1, m)


def test_interleaved_order_and_wraparound():
    p, v, m = 4, 2, 8
    r0 = [(i.chunk, i.micro_batch) for i in rank_schedule("interleaved", p, v, m, 0) if i.op is F]
    # Groups of p micro-batches per chunk: mb 0-3 on chunk 0, mb 0-3 on chunk 4, mb 4-7 on chunk 0, ...
    assert r0 == [(0, 0), (0, 1), (0, 2), (0, 3), (4, 0), (4, 1), (4, 2), (4, 3),
                  (0, 4), (0, 5), (0, 6), (0, 7), (4, 4), (4, 5), (4, 6), (4, 7)]
    r0b = [(i.chunk, i.micro_batch) for i in rank_schedule("interleaved", p, v, m, 0) if i.op is B]
    assert r0b[:5] == [(4, 0), (4, 1), (4, 2), (4, 3), (0, 0)]
    # Warm-up on rank 0 = 2*(p-1) + (v-1)*p = 10 forwards, then F/B alternate.
    ops = [i.op for i in rank_schedule("interleaved", p, v, m, 0) if i.op in (F, B)]
    assert ops[:12] == [F] * 11 + [B]
    # The last rank's chunk 3 feeds rank 0's chunk 4, and rank 0's chunk 4 returns the gradient.
    r3 = rank_schedule("interleaved", p, v, m, 3)
    assert Instruction(Op.SEND_ACT, 3, 0, peer=0) in r3
    assert Instruction(Op.RECV_GRAD, 3, 0, peer=0) in r3
    r0 = rank_schedule("interleaved", p, v, m, 0)
    assert Instruction(Op.RECV_ACT, 4, 0, peer=3) in r0
    assert Instruction(Op.SEND_GRAD, 4, 0, peer=3) in r0
    # Chunk 0 reads the loader and the last chunk starts the backward: no messages for those.
    assert not any(i.op is Op.RECV_ACT and i.chunk == 0 for i in r0)
    assert not any(i.op is Op.RECV_GRAD and i.chunk == p * v - 1 for i in r3)


@pytest.mark.parametrize("args,message", [
    (("interleaved", 4, 2, 6),
     "parallel.schedule=interleaved needs the number of micro-batches m=6 to be a multiple of parallel.pp=4"),
    (("1f1b", 4, 2, 8), "parallel.vpp=2 needs parallel.schedule=interleaved (got 1f1b)"),
    (("gpipe", 4, 3, 8), "parallel.vpp=3 needs parallel.schedule=interleaved (got gpipe)"),
    (("interleaved", 1, 2, 4),
     "parallel.vpp=2 needs parallel.pp > 1 for parallel.schedule=interleaved (got parallel.pp=1)"),
    (("zb", 4, 1, 8), "parallel.schedule='zb' is not one of gpipe, 1f1b, interleaved, zb_h1, zbv"),
    (("zbv", 4, 1, 8), "parallel.schedule=zbv needs parallel.vpp=2 (two chunks per rank in a V), got 1"),
    (("zb_h1", 4, 2, 8), "parallel.vpp=2 needs parallel.schedule=interleaved (got zb_h1)"),
    (("1f1b", 0, 1, 8), "parallel.pp=0 must be an integer >= 1"),
    (("interleaved", 2, 0, 8), "parallel.vpp=0 must be an integer >= 1"),
    (("gpipe", 2, 1, 0), "the number of micro-batches m=0 must be an integer >= 1"),
])
def test_invalid_args_one_line(args, message):
    with pytest.raises(ValueError) as err:
        validate_schedule_args(*args)
    assert str(err.value) == message and "\n" not in message
    with pytest.raises(ValueError):
        build_schedule(*args)


def test_rank_out_of_range():
    with pytest.raises(ValueError, match="pipeline rank 4"):
        rank_schedule("1f1b", 4, 1, 4, 4)


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


def test_timeline_cli_writes_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from mlplat.perf import timeline

    out = tmp_path / "t.png"
    timeline.main(["--schedule", "interleaved", "-p", "2", "-v", "2", "-m", "2", "-o", str(out),
                   "--transfer", "0.1"])
    assert out.stat().st_size > 1000
    assert "bubble" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        timeline.main(["--schedule", "interleaved", "-p", "4", "-v", "2", "-m", "6", "-o", str(out)])


# ---------------------------------------------------------------------------------------------- zero bubble

W = Op.WEIGHT


def _pending_w(ops) -> int:
    pending = peak = 0
    for i in ops:
        pending += (i.op is B) - (i.op is W)
        peak = max(peak, pending)
    return peak


@pytest.mark.parametrize("kind,v", [("zb_h1", 1), ("zbv", 2)])
def test_zero_bubble_schedules(kind, v):
    """Every (chunk, micro-batch) runs F, B and W once, in causal order, without deadlock; zb_h1's bubble is at
    most 1F1B's / 2.5 for m >= 2p, zbv's peak activations at most 1F1B's, pending W's at most p micro-batches."""
    for p in range(1, 9):
        for m in range(1, 4 * p + 1):
            sched = build_schedule(kind, p, v, m)
            check_schedule(sched, p, v, m, kind)  # F, B, W once each, B after F, W after B, inputs in time
            _check_message_placement(sched, p, v, kind)
            one = CostModel(forward=1.0 / v, backward=1.0 / v, weight=1.0 / v, transfer=0.0)
            res = simulate(sched, one, v)
            assert not res.deadlock, (kind, p, m)
            base = simulate(build_schedule("1f1b", p, 1, m), CostModel(forward=1.0, backward=2.0), 1)
            if kind == "zb_h1" and m >= 2 * p:
                assert res.bubble_fraction <= base.bubble_fraction / 2.5 + 1e-12, (p, m)
            assert max(res.peak_in_flight_micro_batches) <= max(base.peak_in_flight_micro_batches), (kind, p, m)
            assert max(_pending_w(ops) for ops in sched) <= p * v, (kind, p, m)


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
