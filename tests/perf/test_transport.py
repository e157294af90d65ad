"""The NCCL point-to-point model (mlplat.perf.transport) catches the posting orders that hang on NCCL.

It is shown to fail on the previous engine's order on one communicator for all pipeline traffic (receives posted
one compute ahead, or at their RECV), on the engine's plans without directed channels, on a plan whose matched
operations carry different messages, on the engine's plans at m = 1 with communicators created at first use, and
on a profiler that synchronises the whole device while receives are posted ahead. That the engine's plans pass
it is tests/parallel/pipeline/test_exchange.py. With the expert dispatch's collectives beside the transfers, the
engine's plans pass it for every schedule, and an ep group spanning two stages or two orders is caught.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from mlplat.parallel.grid import ParallelGrid
from mlplat.parallel.layout.exchange import (
    SEND_WINDOW,
    Compute,
    Post,
    Sync,
    Wait,
    channel_rounds,
    exchange_plans,
    live_buffers,
    with_communicators,
)
from mlplat.parallel.layout.schedules import Instruction, Op, build_schedule
from mlplat.perf.transport import MismatchError, check_plans, run_exchange
from tests.helpers.moe import TOY

COMPUTE = (Op.FORWARD, Op.BACKWARD, Op.WEIGHT)


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


# ------------------------------------------------------------------------------ the host's rules (lazy creation)

M1_CASES = [("gpipe", 2, 1), ("1f1b", 2, 1), ("zb_h1", 2, 1), ("zbv", 2, 2), ("1f1b", 4, 1), ("zbv", 3, 2)]


@pytest.mark.parametrize("kind,p,v", M1_CASES)
def test_checker_reports_the_deadlock_of_lazily_created_communicators_at_one_micro_batch(kind, p, v):
    # m = 1: rank 0 first posts its early RECV_GRAD on (1 -> 0), rank 1 its RECV_ACT on (0 -> 1); each host blocks
    # in a communicator's creation that the other rank never reaches. Created before the step, they pass.
    plans = exchange_plans(build_schedule(kind, p, v, 1))
    res = run_exchange(plans, lazy=True)
    assert res.deadlock and 0 in res.stuck
    assert "CREATE(1->0)" in res.stuck[0] and "rank 1 never reaches its own CREATE" in " | ".join(res.report)
    assert not run_exchange(plans).deadlock  # gloo's view: every communicator exists from the start
    check_plans(with_communicators(plans))


def test_communicators_are_created_in_a_constant_number_of_rounds():
    for p in range(2, 65):
        rounds = channel_rounds(p)
        assert len(rounds) <= 3
        assert sorted(ch for r in rounds for ch in r) == ParallelGrid.p2p_channels(p)
        for r in rounds:  # a rank is in one pair of a round: the pairs' rendezvous happen at the same time
            pairs = {tuple(sorted(ch)) for ch in r}
            ranks = [x for pair in pairs for x in pair]
            assert len(ranks) == len(set(ranks)), (p, r)
    # Timed: creating them costs 2 rendezvous per round, not one per stage (unit rendezvous time, no compute).
    plans = with_communicators([[] for _ in range(64)])
    assert run_exchange(plans).step_time == 0.0 and not run_exchange(plans).deadlock


@pytest.mark.parametrize("kind,p,v,m", [("1f1b", 2, 1, 1), ("1f1b", 4, 1, 8), ("interleaved", 2, 2, 4),
                                        ("zbv", 2, 2, 4), ("zb_h1", 3, 1, 6)])
def test_checker_reports_the_profiler_deadlock_of_a_device_wide_synchronize(kind, p, v, m):
    # The previous profiler ended every span with torch.cuda.synchronize(), which also waits for NCCL's streams:
    # for the receives posted one compute ahead, whose data needs the peer's next compute.
    plans = with_communicators(exchange_plans(build_schedule(kind, p, v, m)))
    synced = [[x for s in plan for x in ((s, Sync()) if isinstance(s, (Compute, Wait)) else (s,))] for plan in plans]
    res = run_exchange(synced, lazy=True)
    assert res.deadlock and "a device-wide synchronize" in " | ".join(res.report)
    check_plans(plans)  # spans that end on the compute stream add no wait on the communication streams


def _experiment_layouts():
    root = Path(__file__).resolve().parents[2] / "conf" / "experiment"
    for path in sorted(root.glob("*.yaml")):
        par = yaml.safe_load(path.read_text())["parallel"]
        m = par["global_batch_size"] // (par["micro_batch_size"] * par["dp"])
        yield path.stem, par["schedule"], par["pp"], par["vpp"], m


def test_every_experiment_layout_is_free_of_deadlock_under_the_host_rules():
    """The exact (schedule, p, v, m) of every conf/experiment/ file (gpt1t: 1f1b, p = 64, m = 512)."""
    seen = []
    for name, kind, p, v, m in _experiment_layouts():
        if p > 1:
            plans = exchange_plans(build_schedule(kind, p, v, m))
            check_plans(with_communicators(plans))
            assert max(map(live_buffers, plans)) <= 2 * SEND_WINDOW + 3, name
            seen.append(name)
    assert "gpt1t" in seen and len(seen) >= 5


# -- the expert dispatch's collectives beside the pipeline's transfers ---------------------------------------

def _expert_cases():
    """Every registered schedule at p <= 4 (its v, or 1 and 2), m = 1, p and 4p where the schedule runs them."""
    from tests.helpers.schedules import schedule_cases

    return [c for c in schedule_cases() if 2 <= c[1] <= 4 and c[2] <= 2 and c[3] in (1, c[1], 4 * c[1])]


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather", "node_alltoall", TOY.name])
def test_expert_dispatch_beside_every_schedule_is_free_of_deadlock(dispatcher):
    """Two replicas of a pipeline (data- or context-parallel ranks: their transfers go to different peers) whose
    stages' ep groups span both, each F and B posting the dispatcher's collectives (its registry entry, each
    waited for by the host) between the engine's transfers, every communicator created before the step: no
    deadlock and no mismatched collective, for every schedule at p <= 4 and m = 1, p and 4p; the test's toy
    dispatcher too."""
    from mlplat.parallel.layout.exchange import Collective, replicated, with_stage_collectives
    from mlplat.specs import dispatchers

    with dispatchers.registered(TOY):
        entry = dispatchers.get(dispatcher)
    names_of = {phase: tuple(what for what, _ in entry.collectives(phase)) for phase in ("forward", "backward")}
    cases = _expert_cases()
    for kind, p, v, m in cases:
        plans = with_communicators(exchange_plans(build_schedule(kind, p, v, m)))
        world = with_stage_collectives(replicated(plans, 2), p, 2, names_of["forward"], names_of["backward"])
        for plan in world:
            ops = [s.instruction.op for s in plan if isinstance(s, Compute)]
            posted = [s for s in plan if isinstance(s, Collective)]
            assert len(posted) == len(names_of["forward"]) * ops.count(Op.FORWARD) + \
                len(names_of["backward"]) * ops.count(Op.BACKWARD) > 0
        check_plans(world, lazy=False)
    assert len({c[0] for c in cases}) >= 7 and len(cases) > 40


def test_expert_collectives_across_stages_or_orders_are_caught():
    """The model sees the two faults the layout rules prevent: an ep group spanning two stages deadlocks at the
    first forward (stage 0 waits in the split sizes' read for stage 1, which waits for stage 0's activation), and
    two replicas of a stage running different orders post mismatched collectives."""
    from mlplat.parallel.layout.exchange import Collective, replicated, with_stage_collectives

    plans = with_communicators(exchange_plans(build_schedule("1f1b", 2, 1, 2)))
    across = []
    for plan in plans:
        steps, group = [], 1000
        for step in plan:
            if isinstance(step, Compute) and step.instruction.op is Op.FORWARD:
                steps += [Collective(group, (0, 1), f"counts {step.instruction.micro_batch}"), Wait(group)]
                group += 1
            steps.append(step)
        across.append(steps)
    res = run_exchange(across)
    assert res.deadlock and "COLL#1000[counts 0 on (0, 1)] waits for rank(s) [1]" in " ".join(res.report)

    mixed = replicated(plans, 2)[:2] + replicated(with_communicators(exchange_plans(build_schedule("gpipe", 2, 1, 2))),
                                                  2)[2:]
    with pytest.raises(MismatchError, match="collective #"):
        check_plans(with_stage_collectives(mixed, 2, 2, ("counts",), ("outputs",)), lazy=False)


def _overlapped_world(p: int, m: int, replicas: int, layers: int = 2) -> list:
    """1f1b_overlap's plans for `replicas` replicas of a p-stage pipeline, their stages' ep groups spanning the
    replicas, each F and B posting the all-to-all dispatcher's collectives for `layers` MoE layers, a pair's
    interleaved as it hands over (`exchange.paired_collectives`)."""
    from mlplat.parallel.layout.exchange import replicated, with_stage_collectives
    from mlplat.specs import dispatchers

    entry = dispatchers.get("alltoall")
    forward, backward = (tuple(w for w, _ in entry.collectives(phase)) * layers for phase in ("forward", "backward"))
    plans = with_communicators(exchange_plans(build_schedule("1f1b_overlap", p, 1, m)))
    return with_stage_collectives(replicated(plans, replicas), p, replicas, forward, backward, entry.hands_over)


def test_overlapped_pairs_are_free_of_deadlock_and_a_swapped_collective_is_caught():
    """1f1b_overlap's pairs post the F's and the B's all-to-alls alternately on one ep communicator, each waited for
    after the other side's next post: under NCCL's rules no deadlock and no mismatch for every p <= 4 at m = 1, p, 2p
    and 4p (ep over two replicas of each stage; ep4 at p = 1). Two collectives of one pair swapped on one rank
    (an order that differs between ranks, the overlap's known failure) are found as a mismatch."""
    from mlplat.parallel.layout.exchange import Collective

    checked = 0
    for p in range(1, 5):
        for m in sorted({1, p, 2 * p, 4 * p}):
            for replicas in (2, 4) if p == 1 else (2,):
                world = _overlapped_world(p, m, replicas)
                check_plans(world, lazy=False)
                checked += 1
    assert checked == 18
    world = _overlapped_world(2, 4, 2)
    plan = world[0]
    first = next(i for i, s in enumerate(plan) if isinstance(s, Collective) and s.what.startswith("outputs +B"))
    before = max(i for i in range(first) if isinstance(plan[i], Collective))  # the F's collective posted just before
    assert "F(" in plan[before].what
    plan[before], plan[first] = plan[first], plan[before]
    with pytest.raises(MismatchError, match="collective #"):
        check_plans(world, lazy=False)


def test_parameter_gathers_beside_every_schedule_are_free_of_deadlock():
    """Sharded parameters (optim.sharding=params, mlplat.optim.param_gather): each F all-gathers its layers' weights
    and each B gathers them again and reduce-scatters their gradients (under a split backward, gathers only: the
    gradients are reduced after the pass), on the communicator of two replicas of its stage, waited for at once by
    the host, between the engine's transfers: no deadlock and no mismatched collective, for every schedule at
    p <= 4 and m = 1, p and 4p."""
    from mlplat.parallel.layout import registry
    from mlplat.parallel.layout.exchange import replicated, with_stage_collectives

    cases = _expert_cases()
    for kind, p, v, m in cases:
        plans = with_communicators(exchange_plans(build_schedule(kind, p, v, m)))
        backward = ("gather",) if registry.get(kind).split_backward else ("gather", "reduce_scatter")
        check_plans(with_stage_collectives(replicated(plans, 2), p, 2, ("gather",), backward), lazy=False)
    assert len({c[0] for c in cases}) >= 7
