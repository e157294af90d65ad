"""The pipeline schedules, one entry each: everything mlplat knows about a schedule, in one place.

Pure data, no torch. An entry is a schedule's order function (one pipeline rank's compute order: its forwards F,
backwards B and, when the backward is split, weight-gradient passes W) and the facts that the rest reads from it:
the layout's rules and chunk placement (`layout.PipelineLayout`), the instruction lists the engine runs
(`schedules.build_schedule`), the simulator and the cost models (`mlplat.perf`), the timeline and the planner
(`mlplat.plan`, which searches every entry).

Adding a schedule is one `register(Schedule(...))` beside its order function: from then on the config accepts its
name, the engine executes it, the simulator times it, the timeline draws it and the planner weighs it. `registered`
adds one for the length of a `with` block (a test's toy schedule). A name keeps its meaning for the life of the
process: the perf models cache what they counted on a schedule by its name.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from mlplat.parallel.layout import orders, zero_bubble
from mlplat.specs.registry import Registry

# (layout, m, rank) -> the rank's compute order: (op, global chunk, micro-batch) with op "F", "B" or "W"; a B of
# a schedule that pairs passes carries a 4th field, True: it runs combined with the F just before it
Order = Callable[..., Sequence[tuple]]


@dataclass(frozen=True)
class Placement:
    """Which pipeline rank holds chunk c, of the p·v."""

    owner: Callable[[int, int], int]  # (chunk, p) -> rank
    note: str  # the placement in words, for the layout's refusals


ROUND_ROBIN = Placement(lambda chunk, p: chunk % p, "chunk c on rank c % p")  # rank r: r, r+p, ..., r+(v-1)p
V_SHAPE = Placement(lambda chunk, p: chunk if chunk < p else 2 * p - 1 - chunk, "two chunks per rank in a V")


@dataclass(frozen=True)
class Schedule:
    name: str  # the value of parallel.schedule
    label: str  # in words: the timeline's title, the docs
    order: Order
    bubble: Callable[[int, int, int], float]  # (p, v, m) -> the papers' bubble fraction; the simulator measures it
    # (p, back_to_back) -> the GPU cost model's bubble in chunk slots of the slowest rank (`perf.cluster.predict`)
    fill: Callable[[int, bool], float]
    placement: Placement = ROUND_ROBIN
    vpp: int | None = 1  # the chunks per rank it runs: 1, 2 (a V) or None for any v (interleaving)
    split_backward: bool = False  # B computes the input gradient, W the weight gradients later (zero bubble)
    groups_of_p: bool = False  # micro-batches go through a chunk in groups of p: m must be a multiple of p
    staggered: bool = True  # rank r finishes about r slots before rank 0 (1F1B's cool-down); GPipe's end together
    steady_state: bool = True  # its activations stop growing with m (GPipe's do not: all m forwards come first)
    one_chunk: str | None = None  # the schedule it is at v = 1, which the config asks for and the planner weighs
    dominated_by: str | None = None  # a schedule as fast on less memory: the planner leaves this one out
    # Its order pairs a forward and a backward as one combined compute, each one's expert all-to-alls flying while
    # the other computes (`mlplat.parallel.pipeline.pair`): for MoE layers under expert parallelism only
    pairs: bool = False


_ENTRIES: Registry[Schedule] = Registry("pipeline schedule", "parallel.schedule")
register, unregister, registered = _ENTRIES.register, _ENTRIES.unregister, _ENTRIES.registered
names, get, schedules = _ENTRIES.names, _ENTRIES.get, _ENTRIES.entries


DEFAULT = "1f1b"  # the schedule of a config that names none


def _one_f_one_b_bubble(p: int, v: int, m: int) -> float:
    return (p - 1) / m


def _warmup_fill(p: int, back_to_back: bool) -> float:
    """Without W's to fill them, 1F1B's p - 1 warm-up slots."""
    return p - 1


def _zero_bubble_fill(p: int, back_to_back: bool) -> float:
    """W fills all but about a third of the warm-up slots (Qi et al.; the simulator is exact)."""
    return (p - 1) / 3


def _overlapped_fill(p: int, back_to_back: bool) -> float:
    """ZB-H1's third, or nothing back to back (post-validation): the next step's head fills this one's tail."""
    return 0 if back_to_back else _zero_bubble_fill(p, back_to_back)


# The papers: Narayanan et al. 2021 (Section 2.2) for the first three; Qi et al., "Zero Bubble Pipeline
# Parallelism", ICLR 2024 and "Pipeline Parallelism with Controllable Memory", 2024 for the others.
register(Schedule("gpipe", "GPipe", orders.gpipe, _one_f_one_b_bubble, _warmup_fill, staggered=False,
                  steady_state=False, dominated_by="1f1b"))
register(Schedule("1f1b", "1F1B (PipeDream-Flush)", orders.one_f_one_b, _one_f_one_b_bubble, _warmup_fill))
register(Schedule("interleaved", "interleaved 1F1B", orders.one_f_one_b, lambda p, v, m: (p - 1) / (v * m),
                  _warmup_fill, vpp=None, groups_of_p=True, one_chunk="1f1b"))
register(Schedule("zb_h1", "ZB-H1 (zero bubble)", zero_bubble.zb_h1, lambda p, v, m: (p - 1) / (3 * m),
                  _zero_bubble_fill, split_backward=True))
# about 0: ZB-H2's across steps, run back to back under optimizer post-validation
register(Schedule("zb_h2", "ZB-H2 (zero bubble back to back, twice 1F1B's memory)", zero_bubble.zb_h2,
                  lambda p, v, m: 0.0, _overlapped_fill, split_backward=True))
register(Schedule("zbv", "ZB-V (zero bubble)", zero_bubble.zbv, lambda p, v, m: 0.0, _overlapped_fill,
                  placement=V_SHAPE, vpp=2, split_backward=True))
# V-Half's papers compare it with 1F1B's bubble; at half the activations it leaves about interleaved v = 2's
# (p - 1) chunk slots of 2m
register(Schedule("v_half", "V-Half (half of 1F1B's memory)", zero_bubble.v_half, _one_f_one_b_bubble,
                  _warmup_fill, placement=V_SHAPE, vpp=2, split_backward=True))
# DeepSeek-V3's DualPipe pairing of a forward with a backward, as Megatron-Core's combined 1F1B runs it (docs/moe.md)
register(Schedule("1f1b_overlap", "1F1B, forward and backward paired over the expert all-to-alls",
                  orders.one_f_one_b_overlap, _one_f_one_b_bubble, _warmup_fill, pairs=True))
