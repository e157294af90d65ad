"""Pipeline schedules (gpipe, 1F1B, interleaved): structure, deadlock freedom, the paper's bubble fractions, peak
activations; the zero-bubble schedules are in test_zero_bubble.py."""

from __future__ import annotations

import pytest

from mlplat.parallel.layout import registry
from mlplat.parallel.layout.orders import warmup_forwards
from mlplat.parallel.layout.pipeline import PipelineLayout
from mlplat.parallel.layout.schedules import Instruction, Op, build_schedule, rank_schedule, validate_schedule_args
from mlplat.perf.simulator import CostModel, check_schedule, simulate
from tests.helpers.schedules import check_message_placement

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
        check_message_placement(sched, p, v)
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
            # Warm-up forwards (GPipe: all of them), then the steady state's first F, then the first B.
            ops = [i.op for i in sched[r] if i.op in (F, B)]
            warmup = m if kind == "gpipe" else warmup_forwards(p, v, m, r)
            assert ops.index(B) == min(warmup + 1, m * v)


def test_api_basics():
    assert registry.names() == ("gpipe", "1f1b", "interleaved", "zb_h1", "zb_h2", "zbv", "v_half", "1f1b_overlap")
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
    (("zb", 4, 1, 8),
     "parallel.schedule='zb' is not one of gpipe, 1f1b, interleaved, zb_h1, zb_h2, zbv, v_half, 1f1b_overlap"),
    (("zbv", 4, 1, 8), "parallel.schedule=zbv needs parallel.vpp=2 (two chunks per rank in a V), got 1"),
    (("v_half", 4, 3, 8), "parallel.schedule=v_half needs parallel.vpp=2 (two chunks per rank in a V), got 3"),
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


def test_overlapped_1f1b_pairs_each_steady_forward_with_an_earlier_backward():
    """1f1b_overlap at every p <= 8 and m <= 3p: valid (check_schedule), each pair a forward and, right after it, an
    earlier micro-batch's backward of the same chunk; the backwards in 1F1B's order (the gradients accumulate as
    1F1B's); rank r warms up with min(2(p-r-1)+1, m) forwards and holds min(2(p-r), m); with the pair
    costing F + B the step is exactly 1F1B's, and it shortens by what the pairs hide."""
    from mlplat.perf.simulator import simulate_nccl

    for p in range(1, 9):
        for m in range(1, 3 * p + 1):
            sched, plain = build_schedule("1f1b_overlap", p, 1, m), build_schedule("1f1b", p, 1, m)
            check_schedule(sched, p, 1, m, "1f1b_overlap")
            for r in range(p):
                ops = sched[r]
                computes = [i for i in ops if i.op in (F, B)]
                assert [(i.chunk, i.micro_batch) for i in computes if i.op is B] == [
                    (i.chunk, i.micro_batch) for i in plain[r] if i.op is B]
                warmup = min(2 * (p - r - 1) + 1, m)
                assert [i.op for i in computes[:warmup]] == [F] * warmup
                for k, ins in enumerate(ops):
                    if ins.paired:
                        assert ops[k - 1].op is F and ops[k - 1].micro_batch > ins.micro_batch
                assert sum(i.paired for i in ops) == m - warmup
            res = simulate(sched, CostModel(1.0, 2.0, 0.0))
            assert res.step_time == simulate(plain, CostModel(1.0, 2.0, 0.0)).step_time
            assert res.peak_in_flight == [min(2 * (p - r), m) for r in range(p)]
            hid = simulate_nccl(sched, CostModel(1.0, 2.0, 0.0, hidden=0.5))
            assert not hid.deadlock and hid.step_time <= res.step_time
            assert hid.step_time < res.step_time or m < 2 * p
