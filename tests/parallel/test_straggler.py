"""Stragglers (mlplat.parallel.straggler): who is named from the exchanged figures, and what a step's clock counts
as work. The multi-process runs (a rank slowed on purpose is named; an even run names nobody) are in
tests/cli/test_straggler.py and tests/cli/test_train.py."""
from __future__ import annotations

import time

import pytest

from mlplat.parallel.straggler import Detector, StepClock, describe, slowest, stragglers


def test_a_rank_is_compared_with_the_median_of_its_own_stage():
    # Two stages of 4 ranks; stage 1 does twice stage 0's work (the loss): no one is slow for being on stage 1.
    roles = [0, 0, 0, 0, 1, 1, 1, 1]
    work = [1.0, 1.02, 0.98, 1.01, 2.0, 2.03, 1.97, 2.0]
    assert stragglers(work, roles, 0.2) == []
    work[6] = 2.5  # 25% above the median (2.0) of the other three of stage 1
    (s,) = stragglers(work, roles, 0.2)
    assert (s.rank, s.role, s.peers, s.median) == (6, 1, 3, 2.0) and s.slowdown == pytest.approx(0.25)
    assert stragglers(work, roles, 0.3) == []  # the threshold is a fraction above the median
    assert slowest(work, roles).rank == 6  # logged at each check, named or not


def test_the_median_is_robust_to_a_second_straggler_and_ranks_are_slowest_first():
    roles = [0] * 6
    work = [1.0, 1.0, 1.0, 1.0, 1.5, 3.0]
    assert [(s.rank, round(s.slowdown, 2)) for s in stragglers(work, roles, 0.2)] == [(5, 2.0), (4, 0.5)]


def test_an_even_run_and_lone_ranks_name_nobody():
    assert stragglers([1.0] * 8, [0, 0, 1, 1, 2, 2, 3, 3], 0.01) == []
    # One rank per stage (pipeline only): no peer does the same work, so nobody is compared.
    assert stragglers([1.0, 5.0, 9.0], [0, 1, 2], 0.2) == [] and slowest([1.0, 5.0, 9.0], [0, 1, 2]) is None


def test_a_rank_is_named_when_slow_at_two_checks_in_a_row():
    detector = Detector([0, 0, 0, 0], 0.2)
    even, slow3, slow2 = [1.0] * 4, [1.0, 1.0, 1.0, 1.5], [1.0, 1.0, 1.5, 1.0]
    seen = [detector.check(w) for w in (slow3, even, slow3, slow2, slow3, slow3, slow3)]
    assert [[s.rank for s in named] for named, _ in seen] == [[], [], [], [], [], [3], [3]]
    assert [worst.rank for _, worst in seen] == [3, 0, 3, 2, 3, 3, 3]  # the slowest, logged at each check


def test_the_line_names_rank_coordinates_host_and_step():
    (s,) = stragglers([1.0, 1.0, 1.6], [0, 0, 0], 0.2)
    line = describe(s, "t0,p0,d2", "node7", 40, [1.6, 0.1, 0.2])
    assert line == ("straggler: rank 2 (t0,p0,d2) on node7 worked 1.600 s in step 40, 60% more than the median "
                    "1.000 s of the 2 other ranks of pipeline stage 0 (its waits: bubble 0.100 s, comm 0.200 s)")


def test_on_a_cpu_a_wait_is_not_work_and_nested_blocks_count_once():
    clock = StepClock("cpu")

    mark = clock.enter()
    time.sleep(0.05)  # a receive's wait
    clock.exit("bubble", mark)
    outer = clock.enter()
    inner = clock.enter()  # nested: inside the outer block's time
    end = time.process_time() + 0.05  # 50 ms of CPU work, however long the shared cores take to give it
    while time.process_time() < end:
        pass
    clock.exit("compute", inner)
    time.sleep(0.05)  # e.g. a tensor-parallel all-reduce inside a forward: waiting, not working
    clock.exit("compute", outer)
    work, bubble, comm = clock.figures()
    # (the wall and CPU clocks of a block differ by a few ms on a loaded machine: comm read 0.0499 for a 50 ms sleep)
    assert 0.05 <= bubble < 0.5 and 0.045 <= work < 0.07 and comm >= 0.04, (work, bubble, comm)


def test_on_a_cpu_a_wait_inside_a_forward_is_not_work_even_when_it_spins():
    """An ep all-to-all inside a forward (the dispatcher's hang-watch block, category ep_comm): its time is the
    forward's comm, its CPU time too (gloo's copies), and blocks inside it count once."""
    from mlplat.parallel.grid import ParallelGrid
    from mlplat.parallel.hang import HangWatch

    def burn(seconds):
        end = time.process_time() + seconds
        while time.process_time() < end:
            pass

    watch = HangWatch(ParallelGrid(rank=0, virtual=True), timeout_s=60)
    watch.clock = clock = StepClock("cpu")
    with watch.blocked_in("F(chunk 0, mb 0)"):
        burn(0.05)
        with watch.blocked_in("the expert dispatch's all-to-all", "ep_comm", completes=False):
            burn(0.03)  # a wait that spins
            with watch.blocked_in("a context-parallel wait inside it", "cp_comm"):
                time.sleep(0.02)
    work, bubble, comm = clock.figures()
    assert 0.045 <= work < 0.07 and comm >= 0.045 and bubble == 0, (work, bubble, comm)
    assert watch.last_completed == "F(chunk 0, mb 0)"  # the wait is no step of the schedule


def _ep_step(stage: int, ep: int, slow: int, labelled: bool, layers: int = 4) -> list[float]:
    """The work each rank of one pipeline stage of `stage` ranks reports for one forward of `layers` MoE layers
    under ep groups of `ep` consecutive ranks, timed by events on simulated compute streams: each layer's attention
    (1 ms) and experts (2 ms), each followed by an all-to-all that every rank of the group leaves when its last rank
    has arrived (+0.1 ms); rank `slow` computes 1.5x slower. labelled: the all-to-alls in their ep_comm blocks (the
    dispatcher's waits), else unlabelled (inside the forward's time, as before they were)."""
    from functools import partial

    from tests.helpers.host_events import HostEvent

    now = [0.0] * stage
    clocks = [StepClock("cuda", event=partial(HostEvent, lambda r=r: now[r])) for r in range(stage)]
    forward = [c.enter("compute") for c in clocks]
    for _ in range(layers):
        for compute in (1e-3, 2e-3):
            for r in range(stage):
                now[r] += compute * (1.5 if r == slow else 1.0)
            waits = [c.enter("ep_comm") if labelled else None for c in clocks]
            for first in range(0, stage, ep):
                done = max(now[first:first + ep]) + 1e-4
                now[first:first + ep] = [done] * ep
            for c, mark in zip(clocks, waits):
                if labelled:
                    c.exit("ep_comm", mark)
    for c, mark in zip(clocks, forward):
        c.exit("compute", mark)
    return [c.figures()[0] for c in clocks]


@pytest.mark.parametrize("stage, ep", [(32, 32), (16, 8)], ids=["ep32-covers-the-stage", "ep8-of-16"])
def test_under_ep_the_rank_the_others_wait_for_is_named(stage, ep):
    """qwen3_235b's stage (ep32 over all 32 ranks) and mixtral_8x7b's (ep8 within 16): a block's stream time holds
    the waits on the all-to-alls, which keep every rank of an ep group at its slowest rank's pace, so timed whole
    the checks name nobody (ep32) or the slow rank's whole group (ep8 of 16); with the waits taken out, that rank
    alone, at the second check."""
    slow = 11
    named = {}
    for labelled in (False, True):
        detector = Detector([0] * stage, 0.2)
        checks = [detector.check(_ep_step(stage, ep, slow, labelled)) for _ in range(2)]
        named[labelled] = [[s.rank for s in found] for found, _ in checks]
    group = sorted(range(slow - slow % ep, slow - slow % ep + ep))
    assert [sorted(n) for n in named[False]] == [[], [] if ep == stage else group]
    assert named[True] == [[], [slow]]
