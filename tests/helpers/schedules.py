"""Checks and case lists shared by the schedule, exchange, zero-bubble and simulator tests."""
from __future__ import annotations

from mlplat.parallel.layout import registry
from mlplat.parallel.layout.pipeline import PipelineLayout
from mlplat.parallel.layout.schedules import Op

F, B = Op.FORWARD, Op.BACKWARD


def gpipe_lifo(layout, m: int, rank: int) -> list[tuple[str, int, int]]:
    """All m forwards, then the backwards from the last micro-batch to the first."""
    return [("F", rank, mb) for mb in range(m)] + [("B", rank, mb) for mb in reversed(range(m))]


# A schedule that only the tests register (`registry.registered(TOY)`): one entry plus its order function.
TOY = registry.Schedule("gpipe_lifo", "GPipe, backwards last in first out", gpipe_lifo,
                        bubble=lambda p, v, m: (p - 1) / m, fill=lambda p, back_to_back: p - 1, staggered=False,
                        steady_state=False)


def check_message_placement(sched, p, v, kind="interleaved"):
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


def schedule_cases():
    """Every registered schedule for p <= 8 (v <= 4 where it runs any v, else its own v) and every valid m up to
    4p."""
    for spec in registry.schedules():
        for p in range(1, 9):
            for v in [1, 2, 3, 4] if spec.vpp is None else [spec.vpp]:
                if v > 1 and p == 1:
                    continue
                for m in range(1, 4 * p + 1):
                    if spec.groups_of_p and m % p:
                        continue
                    yield spec.name, p, v, m
