"""Stragglers: a rank that does its share of a step slower than the ranks doing the same work, named.

Every `straggler.every_steps` steps (the check step), each rank times where that step went from the blocks the
hang watch labels (`hang.HangWatch.blocked_in`: every F/B/W, receive and send wait, gradient reduction and
optimizer step) through a `StepClock`, and the ranks exchange three numbers each in one all-gather of a device
tensor: their **work** (compute, recomputation, the optimizer), **bubble** (pipeline waits) and **comm** (tensor-,
context- and data-parallel waits) seconds. `stragglers` then compares each rank's work with the median of the
other ranks of its role: the ranks of one pipeline stage (every tensor-, context- and data-parallel rank of a
stage runs the same layers on as many tokens; stages differ, the first and last hold the embedding and the loss).
A rank whose work exceeds that median by more than `straggler.threshold` at two checks in a row is named
(`Detector`): one slow step (a pause of the host, a background write) is not a straggler, and a rank slow from
some step on is named at the second check after it, within 2 × `straggler.every_steps` steps.

Work, not the step time: every rank's step takes as long as the slowest's (the pipeline and the collectives wait
for it), so the straggler shows as the rank that waits least and works most.

What a block's work is measured with:
- on a GPU, CUDA events recorded on the current (compute) stream at both ends of each outermost block: the
  stream's own time, the kernels' and the stream's waits on NCCL; the events are read once, at the step's end,
  each by waiting for that event alone (the compute stream up to it, never the device: posted receives of the
  NCCL streams are not waited for, docs/gpu-nccl.md). A tensor-parallel all-reduce inside a forward is
  stream-ordered into it, so a slow rank makes its whole tensor-parallel group slow: the group is slower than
  the other replicas of the stage and each of its ranks is named.
- on a CPU, the process's CPU time (`time.process_time`) over each block: a rank sharing its cores with others
  is not a straggler for being descheduled, and a wait (gloo blocks in the kernel) costs no CPU (a 0.5 s wait in
  an all-to-all, 1 ms); the rest of the block's wall time counts as comm (the collectives inside it). Ranks
  crowded onto few cores still vary: the same work cost up to 28% more CPU time on one of 8 ranks sharing 2 cores
  (evicted caches), against the few percent of a GPU's kernels; the test suite's runs there check with
  `straggler.threshold=0.5`.

Waits inside a computing block are taken out of its work (`_WAITS`): the expert dispatcher's collectives on the
ep group, forward and backward (mlplat.parallel.dispatch), and the context-parallel ring's waits, each a block of
its own inside the forward or backward, timed as the outer blocks are (two more events on the stream, recorded
by the host before the collective is posted and after the stream was made to wait for it: the stream's time in
between is that wait). Every rank of an ep group computes at its slowest one's pace through the all-to-alls, so
a forward timed whole is the same on all of them: the check would name nobody where the ep group covers the stage
(ep32 of 32) and the slow rank's whole group where it does not (ep8 of 16); less its waits it is the rank's own
compute, and the rank the others wait for is named (tests/parallel/test_straggler.py, tests/cli/test_straggler.py).
"""
from __future__ import annotations

import functools
import statistics
import time
from dataclasses import dataclass
from typing import Sequence

import torch

# The hang watch's block categories (`profile.CATEGORIES`) by what the exchanged figures call them.
_BUBBLE = ("bubble",)
_COMM = ("tp_comm", "cp_comm", "ep_comm", "dp_comm")
_WAITS = ("cp_comm", "ep_comm")  # waits inside a forward or backward, taken out of its work (`StepClock`)
FIGURES = ("work", "bubble", "comm")  # per rank, the order of the exchanged tensor's columns


class StepClock:
    """Times the outermost blocks of a `HangWatch` during one step (set as `watch.clock`): `enter` at a block's
    start, `exit` at its end, `figures` after the step. Nested blocks are inside their outer one's time, except a
    wait inside a computing block (an expert-parallel all-to-all inside a forward: `_WAITS`), which is taken out
    of that block's work (the outermost such wait: one inside it is in its time).

    event: what marks a point of the compute stream, a callable returning an object with `elapsed_time(end)` in
    ms and `synchronize()`; default on a GPU: a CUDA event recorded on the current stream (tests give host-timed
    stand-ins, which see a wait as the stream does); None on a CPU: host timing."""

    def __init__(self, device: torch.device | str, event=None):
        device = torch.device(device)
        if event is None and device.type == "cuda":
            event = functools.partial(_cuda_event, device)
        self.event, self.device = event, device
        self.seconds = dict.fromkeys(FIGURES, 0.0)
        self._open: list[str] = []  # the categories of the blocks entered and not left, outermost first
        self._waits: list = []  # the current outer block's timed waits: (start, end) marks
        self._blocks: list[tuple[str, object, object, list]] = []  # events: (category, start, end, waits) at `figures`

    def _mark(self):
        return self.event() if self.event is not None else (time.perf_counter(), time.process_time())

    def enter(self, category: str = "compute"):
        outer = self._open
        outer.append(category)
        if len(outer) == 1 or (category in _WAITS and not any(c in _WAITS for c in outer[:-1])):
            return self._mark()
        return None

    def exit(self, category: str, mark) -> None:
        if self._open:  # (empty: a block entered before this clock was set)
            self._open.pop()
        if mark is None:
            return
        end = self._mark()
        if self._open:  # a wait inside a computing block
            self._waits.append((mark, end))
            return
        waits, self._waits = self._waits, []
        if self.event is not None:
            self._blocks.append((category, mark, end, waits))
            return
        wall, cpu = end[0] - mark[0], end[1] - mark[1]
        # A wait's CPU time (gloo's copies on its worker thread) is comm too
        waits_wall = sum(e[0] - s[0] for s, e in waits)
        waits_cpu = sum(min(e[1] - s[1], e[0] - s[0]) for s, e in waits)
        self._add(category, wall, max(0.0, min(cpu - waits_cpu, wall - waits_wall)))

    def _add(self, category: str, wall: float, work: float) -> None:
        if category in _BUBBLE:
            self.seconds["bubble"] += wall
        elif category in _COMM:
            self.seconds["comm"] += wall
        else:
            self.seconds["work"] += work
            self.seconds["comm"] += wall - work

    def figures(self) -> list[float]:
        """[work, bubble, comm] seconds of the blocks timed (with events: waits for each block's end first)."""
        for category, start, end, waits in self._blocks:
            end.synchronize()  # this event alone (the compute stream up to it), never the device
            wall = start.elapsed_time(end) / 1e3
            waited = sum(s.elapsed_time(e) for s, e in waits) / 1e3
            self._add(category, wall, max(0.0, wall - waited))  # the stream's time less its waits on the ep group
        self._blocks.clear()
        return [self.seconds[f] for f in FIGURES]


def _cuda_event(device: torch.device):
    """A CUDA event recorded now on the current stream of the calling thread (autograd's worker thread runs backward
    on the forward's stream)."""
    event = torch.cuda.Event(enable_timing=True)
    event.record(torch.cuda.current_stream(device))
    return event


@dataclass(frozen=True)
class Straggler:
    rank: int  # global rank
    role: int  # its pipeline stage
    work: float  # its work seconds in the checked step
    median: float  # the median work of the other ranks of its role
    peers: int  # how many those are

    @property
    def slowdown(self) -> float:
        """How much longer its work took than its peers' median, as a fraction (0.35 = 35% slower)."""
        return self.work / self.median - 1 if self.median > 0 else float("inf")


def stragglers(work: Sequence[float], roles: Sequence[int], threshold: float) -> list[Straggler]:
    """The ranks whose work exceeds the median of the other ranks of their role by more than `threshold` (a
    fraction), slowest first. A role of one rank has no peers to compare with: none of it is named."""
    by_role: dict[int, list[int]] = {}
    for rank, role in enumerate(roles):
        by_role.setdefault(role, []).append(rank)
    found = []
    for rank, (seconds, role) in enumerate(zip(work, roles)):
        others = [work[r] for r in by_role[role] if r != rank]
        if not others:
            continue
        s = Straggler(rank, role, float(seconds), float(statistics.median(others)), len(others))
        if s.slowdown > threshold:
            found.append(s)
    return sorted(found, key=lambda s: -s.slowdown)


def slowest(work: Sequence[float], roles: Sequence[int]) -> Straggler | None:
    """The rank furthest above its peers' median (named or not): the figure logged at every check."""
    candidates = stragglers(work, roles, float("-inf"))
    return candidates[0] if candidates else None


class Detector:
    """The checks of one run: `check(work)` gives the ranks named at this check (above the threshold at this check
    and the one before) and the slowest rank of this check (named or not, None without peers)."""

    def __init__(self, roles: Sequence[int], threshold: float):
        self.roles, self.threshold = list(roles), threshold
        self.suspects: set[int] = set()  # above the threshold at the previous check

    def check(self, work: Sequence[float]) -> tuple[list[Straggler], Straggler | None]:
        slow = stragglers(work, self.roles, self.threshold)
        named = [s for s in slow if s.rank in self.suspects]
        self.suspects = {s.rank for s in slow}
        return named, slowest(work, self.roles)


def exchange(figures: Sequence[float], group, world_size: int, device: torch.device) -> torch.Tensor:
    """Every rank's figures, [world_size, len(figures)], through one all-gather of a tensor on `device` (on a GPU a
    CUDA tensor: NCCL takes no other) on `group`; read on the host (the copy waits for the gather only)."""
    import torch.distributed as dist

    mine = torch.tensor(list(figures), dtype=torch.float64, device=device)
    every = torch.empty(world_size * mine.numel(), dtype=torch.float64, device=device)
    dist.all_gather_into_tensor(every, mine, group=group)
    return every.view(world_size, -1).cpu()


def describe(s: Straggler, coords: str, host: str, step: int, figures: Sequence[float]) -> str:
    """The one line naming a straggler."""
    work, bubble, comm = figures
    return (f"straggler: rank {s.rank} ({coords}) on {host} worked {work:.3f} s in step {step}, "
            f"{s.slowdown:.0%} more than the median {s.median:.3f} s of the {s.peers} other rank"
            f"{'s' if s.peers > 1 else ''} of pipeline stage {s.role} (its waits: bubble {bubble:.3f} s, "
            f"comm {comm:.3f} s)")
